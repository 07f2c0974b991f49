"""The parity harness, validated with Lightning's own DDPStrategy before the project's exists.

Positive: DDP over 2 processes equals one process on the global batch, for every model family
and for gradient accumulation with clipping, all in one launch. Negative: the harness can fail (a different learning rate in the reference, a
rank that raises, a rank that quits with status 0, a launch that hangs), without hanging.
"""

from __future__ import annotations

import math
import shutil
import sys

import pytest
import torch

from tests.distributed.cases import CASES, Case, Fault, StrategySpec
from tests.distributed.harness import (
    HarnessError,
    Result,
    _Launch,
    assert_parity,
    mean_over_ranks,
    merge_replicas,
    mismatch,
    reference,
    run_cases,
)

PARITY_CASES = ["ddp2_nanogpt", "ddp2_hf_gpt2", "ddp2_hf_llama", "ddp2_nanogpt_accum_clip", "ddp2_recipe_gpt"]
DDP = StrategySpec("lightning.pytorch.strategies:DDPStrategy", {"process_group_backend": "gloo"})
LR_VARIANT = CASES["ddp2_nanogpt"].replace(name="nanogpt_lr_x1.1", model_kwargs={"learning_rate": 0.11})


@pytest.fixture(scope="module")
def ddp_results() -> dict[str, Result]:
    """All parity cases in ONE 2-process launch, which then computes their references and the
    learning-rate variant's (spread over the ranks, process group closed): one start-up."""
    return run_cases(PARITY_CASES, world_size=2, timeout_s=150, references_for=[*PARITY_CASES, LR_VARIANT])


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", PARITY_CASES)
def test_ddp_matches_single_process(ddp_results: dict[str, Result], name: str) -> None:
    result, ref = ddp_results[name], reference(name)
    assert result.world_size == 2 and result.data_parallel == 2
    case = CASES[name]
    assert result.global_step == case.steps and len(result.losses) == case.batches
    assert all(len(losses) == len(result.losses) for losses in result.rank_losses)
    assert result.rank_losses[0] != result.rank_losses[1]  # the ranks saw different samples
    assert all(n.startswith("model.") for n in result.params)  # the user's names, not DDP's "module."
    assert_parity(result, ref)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_parity_fails_against_a_different_learning_rate(ddp_results: dict[str, Result]) -> None:
    with pytest.raises(AssertionError, match="loss of batch 1") as info:
        assert_parity(ddp_results["ddp2_nanogpt"], reference(LR_VARIANT))
    assert "parameter model.transformer.wte.weight" in str(info.value)
    assert "loss of batch 0" not in str(info.value)  # same initial weights: step 0 agrees


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_rank_that_raises_fails_the_launch_fast() -> None:
    case = Case("fault_raise", "nanogpt", DDP, world_size=2, steps=3, fault=Fault(rank=1, kind="raise"))
    with pytest.raises(HarnessError) as info:
        run_cases([case], world_size=2, timeout_s=100, pg_timeout_s=10)
    message = str(info.value)
    # Failed by rank 1's exit, not by the launch's deadline: the harness reacts to the first rank that fails.
    assert "rank 1 exited with status 1" in message and "timed out after" not in message
    assert "rank 1, case fault_raise" in message and "injected fault on rank 1 at batch 1" in message
    assert "===== rank 0 (killed by the harness) =====" in message or "===== rank 0 (status 1)" in message
    assert (info.value.directory / "error.rank1.txt").exists()
    shutil.rmtree(info.value.directory)


def _fake_launch(code: str, nprocs: int = 2) -> _Launch:
    return _Launch([CASES["ddp2_nanogpt"]], [], nprocs, command=[sys.executable, "-c", code])


@pytest.mark.timeout(30)
def test_rank_that_exits_zero_without_finishing_fails() -> None:
    launch = _fake_launch(
        "import os, sys; sys.exit(0) if os.environ['RANK'] == '1' else __import__('time').sleep(60)"
    )
    with pytest.raises(HarnessError, match="rank 1 exited with status 0 without finishing"):
        launch.wait(timeout_s=20)
    assert all(p.returncode is not None for p in launch.procs)
    shutil.rmtree(launch.dir)


@pytest.mark.timeout(30)
def test_hung_launch_is_killed_at_the_timeout() -> None:
    launch = _fake_launch("print('stuck', flush=True); import time; time.sleep(60)")
    with pytest.raises(HarnessError, match="timed out after 2 s") as info:
        launch.wait(timeout_s=2)
    assert all(p.returncode == -9 for p in launch.procs)  # killed at the deadline, not left to finish
    assert "stuck" in str(info.value)  # each rank's output tail is in the report
    shutil.rmtree(info.value.directory)


def test_mean_over_ranks_skips_ranks_without_loss() -> None:
    # 2 replicas x 2 pipeline stages: only last-stage ranks 1 and 3 have a loss.
    assert mean_over_ranks([[None, None], [1.0, 2.0], [None, None], [3.0, 5.0]]) == [2.0, 3.5]
    assert math.isnan(mean_over_ranks([[None], [None]])[0])
    with pytest.raises(RuntimeError, match="different numbers of batches"):
        mean_over_ranks([[1.0], [1.0, 2.0]])


def test_merge_replicas_reports_copies_out_of_sync() -> None:
    a = torch.ones(3)
    merged = merge_replicas([{"w": a, "b": a}, {"w": a + 1e-8}, {"w": a + 1e-3}])
    assert merged["params"]["w"] is a and merged["params"]["b"] is a
    assert list(merged["replica_mismatches"]) == ["w"] and "rank 2" in merged["replica_mismatches"]["w"]


def _result(**changes) -> Result:
    base = dict(name="x", losses=[2.0, 1.0], params={"w": torch.zeros(4)}, global_step=2, world_size=2,
                data_parallel=2, wall_s=0.0, case_s=0.0, startup_s=0.0,
                compute_dtypes={"forward.addmm.float32": 8})  # fmt: skip
    return Result(**{**base, **changes})


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"losses": [2.0, 1.00002]}, "loss of batch 1"),
        ({"losses": [2.0, math.nan]}, "loss of batch 1"),
        ({"losses": [2.0]}, "batches: 1 vs reference 2"),
        ({"params": {"w": torch.tensor([0.0, 0.0, 0.0, 2e-6])}}, "parameter w"),
        ({"params": {"v": torch.zeros(4)}}, "parameter names differ"),
        ({"global_step": 1}, "optimizer steps"),
        ({"data_parallel": 4}, "data-parallel replicas"),
        ({"replica_mismatches": {"w": "rank 1 differs"}}, "replicas out of sync for w"),
        (
            {"compute_dtypes": {"forward.addmm.float32": 7, "forward.mm.bfloat16": 1}},
            "1 of 8 matrix products",
        ),
        ({"compute_dtypes": {}}, "no matrix product recorded"),
    ],
)
def test_assert_parity_catches(changes: dict, expected: str) -> None:
    assert_parity(_result(losses=[2.0, 1.000005], params={"w": torch.zeros(4) + 5e-7}), _result())  # within
    with pytest.raises(AssertionError, match=expected):
        assert_parity(_result(**changes), _result())


def test_a_16_mixed_run_needs_its_loss_scale_engaged_and_matching_its_references() -> None:
    """The reference of a run over 2 replicas scales by 2 times the run's (the same fp16 gradients)."""
    fp16 = {"precision": "16-mixed", "compute_dtypes": {"forward.addmm.float16": 8}}
    assert_parity(
        _result(**fp16, facts={"loss_scale": 1024.0}), _result(**fp16, facts={"loss_scale": 2048.0})
    )
    # none, not engaged, the reference at the run's own scale or a step skipped apart
    for run, ref in [(None, 2048.0), (1.0, 2.0), (1024.0, 1024.0), (512.0, 2048.0)]:
        with pytest.raises(AssertionError, match="16-mixed loss scales"):
            assert_parity(
                _result(**fp16, facts={"loss_scale": run}), _result(**fp16, facts={"loss_scale": ref})
            )


def test_mismatch() -> None:
    want = torch.tensor([[0.0, 1.0], [2.0, -3.0]])
    assert mismatch(want + torch.tensor([[1e-6, 1e-5], [0.0, 0.0]]), want) is None  # atol, rtol*|want|
    message = mismatch(want + torch.tensor([[0.0, 0.0], [2e-3, 0.0]]), want)
    assert message.startswith("1 of 4 elements differ; greatest difference 0.002 at (1, 0)")
    assert mismatch(torch.full((2, 2), math.nan), want).startswith("4 of 4")
    assert mismatch(torch.zeros(4), want) == "shape (4,) vs reference (2, 2)"


@pytest.mark.parametrize("data_parallel", [1, 2, 3])
def test_reference_batches_hold_the_samples_of_all_replicas(data_parallel: int) -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.models.families import make_dataloader, reference_dataloader

    batch_size, batches, seed = 2, 3, 7
    num_samples = batch_size * data_parallel * batches
    dataset = make_dataloader(batch_size, num_samples).dataset
    # What Lightning builds for a training loader (shuffle forced on, seed = PL_GLOBAL_SEED).
    ranks = [
        list(
            DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset, data_parallel, r, True, seed))
        )
        for r in range(data_parallel)
    ]
    ref = list(reference_dataloader(batch_size, data_parallel, num_samples, sampler_seed=seed))
    assert len(ref) == batches and all(len(batches_of_rank) == batches for batches_of_rank in ranks)
    for i, (x, y) in enumerate(ref):
        assert x.shape == (batch_size * data_parallel, x.shape[1])
        rank_x = torch.cat([ranks[r][i][0] for r in range(data_parallel)])
        assert sorted(map(tuple, rank_x.tolist())) == sorted(map(tuple, x.tolist()))
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_check_parity_asserts_every_case(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.distributed import harness

    cases = [CASES["ddp2_nanogpt"].replace(name=f"fake_{i}", seed=100 + i) for i in range(3)]
    launched = {}

    def fake_run_cases(resolved, world_size, timeout_s, references_for):
        launched.update(cases=[c.name for c in resolved], refs=[c.name for c in references_for])
        return {
            c.name: _result(name=c.name, losses=[2.0, 1.5] if c.name == "fake_1" else [2.0, 1.0])
            for c in resolved
        }

    monkeypatch.setattr(harness, "run_cases", fake_run_cases)
    monkeypatch.setattr(harness, "_REFERENCES", {c.reference_key(): _result(name=c.name) for c in cases})
    with pytest.raises(AssertionError) as info:
        harness.check_parity(cases)
    assert launched == {"cases": ["fake_0", "fake_1", "fake_2"], "refs": ["fake_0", "fake_1", "fake_2"]}
    assert "'fake_1'" in str(info.value) and "'fake_0'" not in str(info.value)
    assert harness.check_parity([cases[0], cases[2]]).keys() == {"fake_0", "fake_2"}


def test_ranks_of_one_tensor_parallel_group_must_report_one_loss() -> None:
    """Shard-local losses whose mean is right still fail: each rank of a tp/cp group must return the loss."""
    from tests.distributed.harness import shared_loss_problems

    coords = [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]

    def result(rank_losses: list[list[float | None]]) -> Result:
        return Result(
            "synthetic", [], {}, 1, 4, 2, 0.0, 0.0, 0.0, rank_losses=rank_losses, rank_coordinates=coords
        )

    assert shared_loss_problems(result([[4.0], [4.0], [3.0], [3.0]])) == []  # replicas differ: fine
    problems = shared_loss_problems(result([[3.9], [4.1], [3.0], [3.0]]))  # the group's mean is 4.0
    assert len(problems) == 1 and "ranks [0, 1]" in problems[0]
    assert shared_loss_problems(result([[4.0], [None], [3.0], [3.0]]))  # one rank without its loss


def test_ranks_without_a_mesh_are_replicas() -> None:
    from tests.distributed.harness import shared_loss_problems

    result = Result(
        "ddp", [], {}, 1, 2, 2, 0.0, 0.0, 0.0, rank_losses=[[4.0], [3.0]], rank_coordinates=[{}, {}]
    )
    assert shared_loss_problems(result) == []
