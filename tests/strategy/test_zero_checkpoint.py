"""Checkpoints under ZeRO: exact resume through Lightning, and consolidation to the unparallelised module.

Two launches of ``scripts/zero_checkpoint.py`` on 2 ranks run every layout: first 4 steps, saved
mid-epoch after step 2 by ``ModelCheckpoint``, then (fresh processes) the resume to step 4.
Layouts: ZeRO-1 and ZeRO-2 on dp=2 (SGD with momentum), ZeRO-3 with CPU offload (AdamW as
DeepSpeed's CPU Adam), ZeRO-2 with tensor parallelism (tp=2, AdamW), ZeRO-1 with two pipeline
stages and with expert parallelism (ep=2, Mixtral), ZeRO-2 in bf16-mixed. The resumed steps must equal the
uninterrupted run's; two checkpoints are also resumed in another layout (ZeRO-1 without ZeRO,
ZeRO-3 with CPU Adam as ZeRO-2 with torch's AdamW, ZeRO-3 with tensor parallelism (FSDP2) as ZeRO-1 with
two pipeline stages (DeepSpeed) and back, ZeRO-3 x tp2 with Adam's states on NVMe as the same with them in
memory). The saved checkpoint, consolidated without processes
(``consolidate_checkpoint`` and ``python -m lightning_parallel export``), must load strictly into
the unparallelised module and equal the weights of the same 2 steps trained in one process
(the parity harness's rule, ``tests/distributed/harness.py:mismatch``). ZeRO-3 with ep=2 runs on
2 ranks (one replica per ep slice) and on 4 (the slices sharded again over 2 replicas, FSDP2),
resumed as itself and as ZeRO-1, and consolidated.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from tests.distributed.cases import RTOL
from tests.strategy import launch
from tests.strategy.scripts.zero_checkpoint import (
    BATCH_SIZE,
    FIRST_HALF,
    LAYOUTS,
    LAYOUTS_FOUR,
    PRECISION,
    RESHARDS,
    RESHARDS_FOUR,
    RESHARDS_INTO_TENSOR_PARALLEL,
    SEED,
    data_parallel,
    samples,
)

# The tests that use ``runs`` are marked distributed (they launch processes); the others start none.


def _read(out: Path, run: str, world_size: int = 2) -> list[dict]:
    return [json.loads((out / f"{run}.rank{rank}.json").read_text()) for rank in range(world_size)]


def _run_layouts(out: Path, layouts: list[str], world_size: int) -> Path:
    """The uninterrupted runs saving ``step2.ckpt``, then the resumes (and reshards) in fresh processes."""
    for mode in ("first", "resume"):
        result = launch("zero_checkpoint.py", [mode, str(out), ",".join(layouts)], out, world_size=world_size,
                        timeout_s=600)  # fmt: skip
        print(f"{mode}: {result.wall_s:.1f} s")
        result.assert_all_succeeded()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run_layouts(tmp_path_factory.mktemp("zero_checkpoint"), list(LAYOUTS), 2)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_under_zero_continues_the_same_run(runs: Path, layout: str) -> None:
    """Masters, optimizer states, step and learning rate restored: steps 3-4 as if never interrupted.

    Bit for bit, except after the first resumed step under DeepSpeed's CPU Adam: its C++ kernel keeps
    ``beta**step`` as a running float product and recomputes it with ``pow`` in a new process, an
    ulp apart (``ops/csrc/includes/cpu_adam.h``, ``IncrementStep``); there, within fp32 parity.
    """
    straight, resumed = _read(runs / layout, "straight"), _read(runs / layout, "resumed")
    assert [r["global_step"] for r in straight + resumed] == [4, 4, 4, 4]
    cpu_adam = LAYOUTS[layout][0].get("offload") is not None
    for rank in range(2):
        want, got = straight[rank]["losses"][FIRST_HALF:], resumed[rank]["losses"]
        if not cpu_adam:
            assert got == want, f"{layout}, rank {rank}: {got} vs {want}"
            continue
        assert got[0] == want[0], f"{layout}, rank {rank}: the restored weights differ ({got} vs {want})"
        assert all(abs(g - w) / abs(w) < RTOL for g, w in zip(got, want, strict=True)), (got, want)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RESHARDS))
def test_zero_checkpoint_resumes_in_another_layout(runs: Path, name: str) -> None:
    """The checkpoint holds the user's layout, so another stage, or no ZeRO at all, resumes it: the first
    step (the weights) exactly, the next within fp32 parity (another reduction order, or another Adam kernel)."""
    source, target = RESHARDS[name]
    # Under tensor parallelism the loss runs on the vocabulary shards (another summation order than one
    # F.cross_entropy): the same weights then give a first loss equal to the last fp32 bits or two, not bitwise.
    same_loss = (LAYOUTS[source][0].get("tensor_parallel", 1) > 1) == (target.get("tensor_parallel", 1) > 1)
    straight, resumed = _read(runs / source, "straight"), _read(runs / name, "resumed")
    for rank in range(2):
        want, got = straight[rank]["losses"][FIRST_HALF:], resumed[rank]["losses"]
        ulps = 0 if same_loss else 2
        assert abs(got[0] - want[0]) <= ulps * float(torch.finfo(torch.float32).eps) * abs(want[0]), (
            f"{name}, rank {rank}: the restored weights differ ({got} vs {want})"
        )
        assert all(abs(g - w) / abs(w) < RTOL for g, w in zip(got, want, strict=True)), (got, want)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RESHARDS_INTO_TENSOR_PARALLEL))
def test_zero_checkpoint_resumes_into_tensor_parallelism(runs: Path, name: str) -> None:
    """A checkpoint of another engine and layout (DeepSpeed's ZeRO-1 under two pipeline stages) continues under
    ZeRO-3 with tensor parallelism (FSDP2) within fp32 parity from its first step on."""
    source, _ = RESHARDS_INTO_TENSOR_PARALLEL[name]
    straight, resumed = _read(runs / source, "straight"), _read(runs / name, "resumed")
    for rank in range(2):
        want, got = straight[rank]["losses"][FIRST_HALF:], resumed[rank]["losses"]
        assert len(got) == len(want) > 0
        assert all(abs(g - w) / abs(w) < RTOL for g, w in zip(got, want, strict=True)), (
            name,
            rank,
            got,
            want,
        )


@cache
def _single_process(family: str, overrides: tuple, dp: int, world_size: int = 2) -> dict[str, torch.Tensor]:
    """The same steps in one process, the harness's way: the samples of all data-parallel ranks per batch."""
    import lightning as L

    from tests.models.families import build, reference_dataloader

    L.seed_everything(SEED, verbose=False)
    model = build(family, **dict(overrides))
    loader = reference_dataloader(BATCH_SIZE, dp, samples(world_size), sampler_seed=SEED)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=FIRST_HALF, deterministic=True, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, loader)
    return model.state_dict()


FP32 = [layout for layout in LAYOUTS if layout not in PRECISION]


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", FP32)
def test_consolidated_checkpoint_is_the_single_process_module(runs: Path, layout: str) -> None:
    from lightning_parallel import consolidate_checkpoint
    from tests.distributed.harness import mismatch
    from tests.models.families import build

    _, family, overrides = LAYOUTS[layout]
    consolidated = consolidate_checkpoint(runs / layout / "step2.ckpt")
    reference = _single_process(family, tuple(sorted(overrides.items())), data_parallel(layout))
    assert set(consolidated) == set(reference)
    assert all(v.dtype == torch.float32 for v in consolidated.values())
    problems = {name: mismatch(consolidated[name], reference[name]) for name in reference}
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}
    fresh = build(family, **overrides)
    assert any(not torch.equal(v, consolidated[k]) for k, v in fresh.state_dict().items())  # trained weights
    fresh.load_state_dict(consolidated, strict=True)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_export_command_writes_the_consolidated_weights(runs: Path, tmp_path: Path) -> None:
    """``python -m lightning_parallel export`` (the command for every checkpoint) on a ZeRO + tp=2 checkpoint."""
    from safetensors.torch import load_file

    from lightning_parallel import consolidate_checkpoint
    from lightning_parallel.cli import main

    checkpoint, out = runs / "zero2_tp2" / "step2.ckpt", tmp_path / "weights.safetensors"
    assert main(["export", str(checkpoint), str(out), "--dtype", "float32"]) == 0
    exported, consolidated = load_file(out), consolidate_checkpoint(checkpoint)
    assert set(exported) == set(consolidated)
    for name, value in consolidated.items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0, msg=name)


def test_consolidated_save_is_refused_under_zero() -> None:
    """One file would gather every master on rank 0 at each save: refused, with the offline way named."""
    from lightning_parallel import HybridParallelStrategy

    with pytest.raises(ValueError, match="consolidate_checkpoint"):  # at construction, before any launch
        HybridParallelStrategy(zero_stage=2, save_distributed_checkpoint=False)
    strategy = HybridParallelStrategy(zero_stage=2)
    strategy._save_distributed_checkpoint = False  # switched after construction: refused at the save
    with pytest.raises(ValueError, match="consolidate_checkpoint"):
        strategy._check_consolidated_supported()


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_bf16_checkpoint_holds_what_bf16_training_made(runs: Path) -> None:
    """bf16-mixed under ZeRO (an fp32 engine under autocast): every linear of the run and of its resume computed
    in bf16 (DeepSpeed's autocast check sees the CPU, as on a GPU, so an engine config that switched Lightning's
    autocast off would show), and the checkpoint holds the fp32 weights of that training: they load strictly
    into the plain module, moved from the initial ones, and differ from the same steps trained in fp32 beyond
    fp32 parity (the bf16 rounding is in them). Negative control: the fp32 ZeRO-2 run of the same layout
    computed every linear in fp32, and its checkpoint is the fp32 run's (test_consolidated_checkpoint_...)."""
    from lightning_parallel import consolidate_checkpoint
    from tests.distributed.harness import mismatch
    from tests.models.families import build

    for run in ("straight", "resumed"):
        for rank in _read(runs / "zero2_bf16", run):
            assert set(rank["linear_dtypes"]) == {"torch.bfloat16"}, (run, rank["linear_dtypes"])
        for rank in _read(runs / "zero2", run):  # the same layout in fp32
            assert set(rank["linear_dtypes"]) == {"torch.float32"}, (run, rank["linear_dtypes"])
    _, family, overrides = LAYOUTS["zero2_bf16"]
    consolidated = consolidate_checkpoint(runs / "zero2_bf16" / "step2.ckpt")
    assert all(v.dtype == torch.float32 for v in consolidated.values())
    fresh = build(family, **overrides)
    fresh.load_state_dict(consolidated, strict=True)
    initial = build(family, **overrides).state_dict()
    assert all(
        not torch.equal(initial[k], consolidated[k]) for k in consolidated if "weight" in k and "ln" not in k
    )
    fp32 = _single_process(family, tuple(sorted(overrides.items())), data_parallel("zero2_bf16"))
    assert mismatch(
        consolidated["model.transformer.h.0.mlp.c_fc.weight"], fp32["model.transformer.h.0.mlp.c_fc.weight"]
    )


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", ["zero2_gcompute_bf16", "zero3_gcompute_bf16"])
def test_checkpoints_of_compute_gathers_hold_the_fp32_shards(runs: Path, layout: str) -> None:
    """``zero_gather_dtype="compute"``: the module holds bf16 gathered copies during a step (and between steps at
    ZeRO-2), the checkpoint the fp32 shards the optimizer steps (FSDP2 saves its sharded parameters): fp32 values
    that are not all bf16-representable, loading strictly into the plain module. Resumed bit for bit by
    test_resume_under_zero_continues_the_same_run."""
    from lightning_parallel import consolidate_checkpoint
    from tests.models.families import build

    for run in ("straight", "resumed"):
        for rank in _read(runs / layout, run):
            assert set(rank["linear_dtypes"]) == {"torch.bfloat16"}, (run, rank["linear_dtypes"])
    _, family, overrides = LAYOUTS[layout]
    consolidated = consolidate_checkpoint(runs / layout / "step2.ckpt")
    assert all(v.dtype == torch.float32 for v in consolidated.values())
    weight = consolidated["model.transformer.h.0.mlp.c_fc.weight"]
    assert not torch.equal(weight, weight.bfloat16().float())  # the masters, not the gathered copies
    build(family, **overrides).load_state_dict(consolidated, strict=True)


def test_zero3_partition_of_an_uneven_weight() -> None:
    """A weight whose size does not divide by the ranks: the last rank's ZeRO-3 partition is padded with
    zeros (DeepSpeed's own full-value setter cuts past the end there, so the resume writes partitions)."""
    from lightning_parallel.zero.partitions import partition_of

    value = torch.arange(1.0, 8.0).reshape(7, 1)  # 7 elements on 2 ranks: partitions of 4
    assert partition_of(value, 0, 4).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert partition_of(value, 1, 4).tolist() == [5.0, 6.0, 7.0, 0.0]


# ---- four ranks: expert slices sharded again over their replicas ---------------------------------------


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _run_layouts(tmp_path_factory.mktemp("zero_checkpoint_four"), list(LAYOUTS_FOUR), 4)


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS_FOUR))
def test_replica_sharded_experts_resume_reshard_and_consolidate(four_rank_runs: Path, layout: str) -> None:
    """ZeRO-3 x ep2 x dp_replicate=2 (also with cp=2, ep then flattened from two mesh axes): the same run
    continues, ZeRO-1 resumes it, and the consolidated file is the single process's module (each rank's
    quarter of an expert tensor in its place)."""
    from lightning_parallel import consolidate_checkpoint
    from tests.distributed.harness import mismatch

    straight = _read(four_rank_runs / layout, "straight", 4)
    resumed = _read(four_rank_runs / layout, "resumed", 4)
    for rank in range(4):
        assert resumed[rank]["losses"] == straight[rank]["losses"][FIRST_HALF:], rank
    for name, (source, _) in RESHARDS_FOUR.items():
        if source != layout:
            continue
        other = _read(four_rank_runs / name, "resumed", 4)
        for rank in range(4):
            want, got = straight[rank]["losses"][FIRST_HALF:], other[rank]["losses"]
            assert got[0] == want[0], f"{name}, rank {rank}: the restored weights differ ({got} vs {want})"
            assert all(abs(g - w) / abs(w) < RTOL for g, w in zip(got, want, strict=True)), (got, want)
    _, family, overrides = LAYOUTS_FOUR[layout]
    consolidated = consolidate_checkpoint(four_rank_runs / layout / "step2.ckpt")
    reference = _single_process(family, tuple(sorted(overrides.items())), data_parallel(layout, 4), 4)
    assert set(consolidated) == set(reference)
    problems = {name: mismatch(consolidated[name], reference[name]) for name in reference}
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}
