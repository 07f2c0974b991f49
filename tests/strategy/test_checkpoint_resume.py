"""Save a checkpoint mid-epoch and resume it in the same layout: the same batches, the same losses, bit for bit.

tp=2 on 2 processes, the recipe GPT (fused q|k|v, tied embedding, dropout 0.1), fp32, AdamW with
a warmup + cosine schedule, a shuffled plain DataLoader of 4 batches per epoch (also pp=2, dp=2, ep=2,
fp16, the user's own sampler, torchdata's StatefulDataLoader under tp=2, pp=2 and dp=2, an
IterableDataset under tp=2 and pp=2). Every
save path: ``ModelCheckpoint``, ``trainer.save_checkpoint`` after ``fit``, ``OnExceptionCheckpoint``
on an exception and on Ctrl+C (one rank signalled), SLURM's requeue signal (``SLURMAutoRequeue``). One launch trains
6 steps straight, then 3 steps, saved by ``ModelCheckpoint`` in the middle of the first epoch
twice: sharded (``torch.distributed.checkpoint``, the default) and consolidated. A second launch
(fresh processes) resumes each to step 6: batch 4 of epoch 0 (the data loader's position), then
epoch 1 in the uninterrupted run's order (samplers and random states restored); steps 4-6 must
equal the straight run exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.strategy import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def _read(out: Path, run: str, world_size: int = 2) -> list[dict]:
    return [json.loads((out / f"{run}.rank{rank}.json").read_text()) for rank in range(world_size)]


def _assert_exact(resumed: dict, straight: dict, what: str) -> None:
    """A resume in the same layout is the uninterrupted run: the same batches and bit-identical losses."""
    assert resumed["batches"] == straight["batches"][3:], f"{what}: data order {resumed['batches']}"
    assert resumed["losses"] == straight["losses"][3:], f"{what}: {resumed['losses']} vs {straight['losses']}"


LAYOUTS = (
    "tp2",
    "pp2",
    "ep2",
    "tp2_fp16",
    "tp2_sampler",
    "dp2",
    "tp2_stateful",
    "pp2_stateful",
    "dp2_stateful",
    "tp2_iterable",
    "pp2_iterable",
)
# A save at the start of an epoch's last batch (the exception and Ctrl+C runs stop there) resumes an
# IterableDataset into the next epoch: Lightning's loop flags the fetched batch as the last, and without a
# length nothing tells it the batch was not trained (docs/checkpoints.md, "Not covered yet").
STOPPED_AT_A_BATCH = tuple(layout for layout in LAYOUTS if not layout.endswith("_iterable"))


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both launches of ``scripts/checkpoint_resume.py``, every layout in each: straight and first half + save,
    then (fresh processes) the resumes."""
    out = tmp_path_factory.mktemp("checkpoint_resume")
    for mode in ("first", "resume"):
        result = launch("checkpoint_resume.py", [mode, str(out), ",".join(LAYOUTS)], out, timeout_s=400)
        print(f"{mode}: {result.wall_s:.1f} s")
        result.assert_all_succeeded()
    return out


@pytest.fixture(scope="module")
def checkpoint_runs(all_runs: Path) -> Path:
    return all_runs / "tp2"


def test_resume_from_sharded_checkpoint_continues_the_same_run(checkpoint_runs: Path) -> None:
    straight, first, resumed = (_read(checkpoint_runs, run) for run in ("straight", "first_half", "resumed"))
    assert [r["global_step"] for r in straight + first + resumed] == [6, 6, 3, 3, 6, 6]
    assert (checkpoint_runs / "step3.ckpt").is_dir()  # the sharded format, one folder for all ranks
    reference = straight[0]["losses"]
    assert len(reference) == 6 and reference[3:] != reference[:3]
    for rank in range(2):
        # Tensor-parallel ranks compute the same (replicated) loss.
        assert straight[rank]["losses"] == reference
        assert first[rank]["losses"] == reference[:3]
        _assert_exact(resumed[rank], straight[rank], f"resumed from the sharded checkpoint, rank {rank}")


@pytest.fixture(scope="module")
def pipeline_checkpoint_runs(all_runs: Path) -> Path:
    return all_runs / "pp2"


def test_pipeline_resume_from_sharded_checkpoint_continues_the_same_run(
    pipeline_checkpoint_runs: Path,
) -> None:
    """Two pipeline stages (each saves only its own blocks; the tied embedding/head on both ends,
    identical): stop after one epoch, resume in fresh processes, same losses as the straight run."""
    out = pipeline_checkpoint_runs
    straight, first, resumed = (_read(out, run) for run in ("straight", "first_half", "resumed"))
    assert [r["global_step"] for r in straight + first + resumed] == [6, 6, 3, 3, 6, 6]
    reference = straight[0]["losses"]
    for rank in range(2):
        # Every stage reports the last stage's loss.
        assert straight[rank]["losses"] == reference
        _assert_exact(
            resumed[rank], straight[rank], f"pp=2, resumed from the sharded checkpoint, rank {rank}"
        )


@pytest.fixture(scope="module")
def expert_checkpoint_runs(all_runs: Path) -> Path:
    return all_runs / "ep2"


def test_expert_parallel_resume_from_sharded_checkpoint(expert_checkpoint_runs: Path, tmp_path: Path) -> None:
    """ep=2 (MoE recipe, 4 experts, drops): each rank holds 2 experts' rows of the same stacked
    weights; the checkpoint must hold all 4 and resume to the same losses (and batches)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = expert_checkpoint_runs
    straight, resumed = _read(out, "straight"), _read(out, "resumed")
    assert [r["global_step"] for r in straight + resumed] == [6, 6, 6, 6]
    for rank in range(2):  # two data-parallel ranks: Lightning's DistributedSampler, each its own batches
        _assert_exact(resumed[rank], straight[rank], f"ep=2, resumed, rank {rank}")
    dcp_to_torch_save(out / "step3.ckpt", tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)
    experts = {k: v for k, v in converted["state_dict"].items() if ".experts." in k}
    assert experts and all(v.shape[0] == 4 for v in experts.values()), {
        k: v.shape for k, v in experts.items()
    }
    optimizer_experts = [k for k in converted["optimizer_0"] if ".experts." in k and k.startswith("state.")]
    assert optimizer_experts and all(
        converted["optimizer_0"][k].shape[0] == 4
        for k in optimizer_experts
        if converted["optimizer_0"][k].dim()
    )


def test_resume_from_consolidated_checkpoint_continues_the_same_run(checkpoint_runs: Path) -> None:
    straight, resumed = _read(checkpoint_runs, "straight"), _read(checkpoint_runs, "resumed_full")
    assert (checkpoint_runs / "step3.full.ckpt").is_file()
    for rank in range(2):
        assert resumed[rank]["global_step"] == 6
        _assert_exact(resumed[rank], straight[rank], f"resumed from the full file, rank {rank}")


def test_sharded_checkpoint_holds_the_unsharded_layout(checkpoint_runs: Path, tmp_path: Path) -> None:
    """The folder converts to one ordinary state dict equal to the consolidated file: fused q|k|v
    in the user's own [q; k; v] order, so the checkpoint can leave the strategy."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint_runs / "step3.ckpt", tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)["state_dict"]
    full = torch.load(checkpoint_runs / "step3.full.ckpt", weights_only=False)["state_dict"]
    assert set(full) <= set(converted)
    for name, tensor in full.items():
        torch.testing.assert_close(converted[name], tensor, rtol=0, atol=0, msg=name)
    assert converted["model.transformer.h.0.attn.qkv.weight"].shape == (96, 32)


def test_cli_arithmetic_matches_the_sharded_model(checkpoint_runs: Path) -> None:
    """``python -m lightning_parallel plan`` computes bytes per rank without processes; they must
    be what the strategy recorded from the really sharded model."""
    from lightning_parallel.cli import parameter_shards
    from lightning_parallel.plans import auto_plan
    from recipes.gpt.module import GPTLightningModule
    from tests.strategy.scripts.checkpoint_resume import MODEL

    recorded = {
        name: tuple(sizes)
        for name, sizes in _read(checkpoint_runs, "straight")[0]["parameter_shards"].items()
    }
    model = GPTLightningModule(**MODEL)
    computed = parameter_shards(auto_plan(model, 2, sequence_parallel=False), model)
    assert computed == recorded


def test_fp16_resume_restores_the_loss_scaler(all_runs: Path) -> None:
    """``"16-mixed"``, the scale doubling every 2 steps from 2**8: the resumed run continues at the saved
    scale and growth counter (a fresh scaler would restart at 2**8), with the same losses."""
    out = all_runs / "tp2_fp16"
    straight, resumed = _read(out, "straight"), _read(out, "resumed")
    for rank in range(2):
        assert straight[rank]["scales"][-1] > 2.0**8, straight[rank]["scales"]
        assert resumed[rank]["scales"] == straight[rank]["scales"][3:], (resumed[rank], straight[rank])
        _assert_exact(resumed[rank], straight[rank], f"fp16, resumed, rank {rank}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_checkpoint_saved_after_fit_returned_continues_the_same_run(all_runs: Path, layout: str) -> None:
    """``trainer.save_checkpoint(path)`` once ``fit`` stopped at ``max_steps`` mid-epoch, then ``fit(ckpt_path=path)``
    with a larger ``max_steps``: the rest of the epoch, then the next, bit for bit (plain Lightning
    restarts the epoch from its first batch: it counts the cut epoch as finished)."""
    straight, resumed = _read(all_runs / layout, "straight"), _read(all_runs / layout, "resumed_after_fit")
    for rank in range(2):
        assert resumed[rank]["global_step"] == 6
        _assert_exact(resumed[rank], straight[rank], f"{layout}, resumed from a save after fit, rank {rank}")


@pytest.mark.parametrize("layout", STOPPED_AT_A_BATCH)
def test_a_checkpoint_saved_on_an_exception_continues_the_same_run(all_runs: Path, layout: str) -> None:
    """An exception before step 4, ``OnExceptionCheckpoint`` saving, then ``fit(ckpt_path=...)``: bit for bit."""
    straight, resumed = _read(all_runs / layout, "straight"), _read(all_runs / layout, "resumed_after_crash")
    crashed = _read(all_runs / layout, "crashed")
    for rank in range(2):
        assert crashed[rank]["losses"] == straight[rank]["losses"][:3]  # it trained 3 steps, then raised
        assert resumed[rank]["global_step"] == 6
        _assert_exact(
            resumed[rank], straight[rank], f"{layout}, resumed from the exception's checkpoint, rank {rank}"
        )


@pytest.mark.parametrize("layout", STOPPED_AT_A_BATCH)
def test_ctrl_c_on_one_rank_stops_every_rank_at_one_step_and_resumes_exactly(
    all_runs: Path, layout: str
) -> None:
    """SIGINT on rank 1 only, after step 2: every rank stops before step 4 (the strategy agrees on the step
    through the process group's store), ``OnExceptionCheckpoint`` saves, and the resumed run is the straight
    one bit for bit. Without the agreement rank 0 would train on alone (a hang) or save another step."""
    straight, interrupted = _read(all_runs / layout, "straight"), _read(all_runs / layout, "interrupted")
    resumed = _read(all_runs / layout, "resumed_after_interrupt")
    for rank in range(2):
        assert interrupted[rank]["losses"] == straight[rank]["losses"][:3], (rank, interrupted[rank])
        assert resumed[rank]["global_step"] == 6
        _assert_exact(resumed[rank], straight[rank], f"{layout}, resumed after Ctrl+C, rank {rank}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_slurm_signal_saves_at_a_step_boundary_and_resumes_exactly(all_runs: Path, layout: str) -> None:
    """SLURM's requeue signal on rank 0 after step 2 (SLURM's variables, a ``scontrol`` whose requeue fails so
    training goes on): ``SLURMAutoRequeue`` saves ``hpc_ckpt_1.ckpt`` after step 3 on every rank; the signalled
    run itself is unchanged, and resuming from its checkpoint continues the straight run bit for bit."""
    straight, signalled = _read(all_runs / layout, "straight"), _read(all_runs / layout, "signalled")
    resumed = _read(all_runs / layout, "resumed_after_signal")
    for rank in range(2):
        assert signalled[rank]["losses"] == straight[rank]["losses"]
        _assert_exact(resumed[rank], straight[rank], f"{layout}, resumed after SLURM's signal, rank {rank}")
