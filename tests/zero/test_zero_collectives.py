"""ZeRO-2/3 under pipeline stages communicates once per optimizer step, not once per micro-batch (counted).

Two stages x two data-parallel ranks, 4 micro-batches (tests/strategy/scripts/zero_collectives.py):
each FSDP2 unit of a rank reduce-scatters its gradients once per step, after the schedule, and
gathers its parameters once (ZeRO-3 before the first micro-batch, ZeRO-2 after the optimizer step,
keeping whole parameters between steps). Once per micro-batch would be 4x that. ZeRO-2 with expert
parallelism (ep=2 x dp_replicate=2, no stages, the experts' units of their own over their replicas):
also one of each per unit and step. With ``zero_reshard="micro_batch"`` (memory asked for): one
reduce-scatter per micro-batch, and at stage 3 a gather for every forward and backward.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.strategy import launch

pytestmark = [pytest.mark.distributed]

MICRO_BATCHES = 4  # the script's


@pytest.mark.timeout(600)
def test_one_gather_and_one_reduce_scatter_per_unit_and_step(tmp_path: Path) -> None:
    result = launch("zero_collectives.py", [str(tmp_path)], tmp_path, world_size=4, timeout_s=400, grace_s=30)
    result.assert_all_succeeded()
    for rank in range(4):
        measured = json.loads((tmp_path / f"zero_collectives.rank{rank}.json").read_text())
        expected = {  # per unit and optimizer step
            "zero2": (1, 1),
            "zero3": (1, 1),
            "zero2_ep2": (1, 1),
            # zero_reshard="micro_batch", 4 micro-batches: a reduce-scatter per micro-batch; ZeRO-3 gathers for
            # every forward and every backward, ZeRO-2 keeps its parameters whole until after the step.
            "zero2_per_micro_batch": (1, MICRO_BATCHES),
            "zero3_per_micro_batch": (2 * MICRO_BATCHES, MICRO_BATCHES),
        }
        for stage, (gathers, reduce_scatters) in expected.items():
            units, steps = measured[stage]["units"], measured[stage]["steps"]
            assert units >= 2 and len(steps) == 2  # blocks of the stage, and the rest of the model
            for counted in steps:
                assert counted == {
                    "all_gather": gathers * units,
                    "reduce_scatter": reduce_scatters * units,
                }, (
                    rank,
                    stage,
                    units,
                    counted,
                )


@pytest.mark.timeout(600)
def test_a_second_fit_trains_the_reused_sharded_module(tmp_path: Path) -> None:
    """fit, then fit again on the same module under ZeRO-2 x ep2 (FSDP2): the reused module's optimizer
    is built on the shards (not the whole parameters ZeRO-2 keeps between steps), so the second fit trains."""
    result = launch("zero_refit.py", [str(tmp_path)], tmp_path, world_size=2, timeout_s=400, grace_s=30)
    result.assert_all_succeeded()
    for rank in range(2):
        measured = json.loads((tmp_path / f"zero_refit.rank{rank}.json").read_text())
        assert measured["optimizer_holds_shards"], measured
        assert measured["moved"] > 1e-3, measured


@pytest.mark.timeout(600)
def test_zero3_with_parameters_on_the_host_gathers_the_next_block_ahead(tmp_path: Path) -> None:
    """With ``offload="cpu"`` each block's forward has already started the next block's gather (copy up from the
    host, all-gather) when it runs; without offload FSDP2 gathers each block in its own pre-forward (the control)."""
    result = launch("zero_prefetch.py", [str(tmp_path)], tmp_path, world_size=2, timeout_s=400, grace_s=30)
    result.assert_all_succeeded()
    for rank in range(2):
        measured = json.loads((tmp_path / f"zero_prefetch.rank{rank}.json").read_text())
        # Gathers issued before each of the 3 blocks' forwards: the rest of the model (embeddings, head) and
        # block 0 before the first; then, with prefetch, one block ahead.
        assert measured["cpu"] == [3, 4, 4], (rank, measured)
        assert measured["None"] == [2, 3, 4], (rank, measured)
