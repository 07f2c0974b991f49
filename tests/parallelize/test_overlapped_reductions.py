"""The data-parallel reduction under pipeline stages and sharded experts overlaps the last backward (counted).

Four gloo ranks train each layout of ``tests/strategy/scripts/overlap_collectives.py`` for three
optimizer steps and record every bucket launch of the explicit reductions and every FSDP2
reduce-scatter: during which batch, inside a backward or not, inside the pipeline schedule or
not, and how many buckets still waited for gradients at that moment. Counted, never timed:

- one launch per bucket per optimizer step (none on an accumulating batch), one reduce-scatter
  per FSDP2 unit per batch, and their bytes the theoretical volume: every gradient once (FSDP2's
  padded size for the reduce-scatters);
- launched inside the last backward (autograd's engine running), and at least one per step while
  buckets of the same reduction still waited for gradients still to be computed: the reduction
  overlaps the backward work after it. Under the zero-bubble schedules the weight gradients are
  assigned outside autograd's accumulation, so their buckets launch after each stage's last weight
  pass, still inside the schedule.

Negative control: the same layouts with the overlap switched off (reductions after the schedule,
as before) fail the checks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.strategy import launch

pytestmark = [pytest.mark.distributed]

# layout: (what is reduced, must it launch inside autograd's backward)
EXPECTED = {
    "pp2_dp2_1f1b": ("bucket", True),
    "pp2_dp2_interleaved": ("bucket", True),
    "pp2_dp2_zbv": ("bucket", False),
    "pp2_dp2_accum": ("bucket", True),
    "ep2_dp2": ("bucket", True),
    "zero3_pp2_1f1b": ("reduce_scatter", True),
    "zero2_pp2_zbv": ("reduce_scatter", False),
}


def overlap_problems(result: dict[str, Any], kind: str, in_backward: bool, pipelined: bool) -> list[str]:
    """What is wrong with one layout's recorded reductions on one rank (empty: overlapped, once per step)."""
    per_launch = sum(result["buckets"]) if kind == "bucket" else result["units"]
    theory = result["bucket_bytes"] if kind == "bucket" else result["unit_bytes"]
    accumulate, problems = result["accumulate"], []
    if per_launch < 2:
        problems.append(f"only {per_launch} {kind}(s) per step: nothing to overlap")
    events = [e for e in result["events"] if e["kind"] == kind]
    for batch in range(result["steps"] * accumulate):
        launched = [e for e in events if e["batch"] == batch]
        final = kind == "reduce_scatter" or (batch + 1) % accumulate == 0
        if len(launched) != (per_launch if final else 0):
            problems.append(
                f"batch {batch}: {len(launched)} {kind} launches, expected {per_launch if final else 0}"
            )
        if final and sum(e["bytes"] for e in launched) != theory:
            problems.append(
                f"batch {batch}: {sum(e['bytes'] for e in launched)} bytes reduced, theory {theory}"
            )
        if pipelined and not all(e["in_schedule"] for e in launched):
            problems.append(f"batch {batch}: {kind} launched after the pipeline schedule")
        if in_backward and not all(e["in_backward"] for e in launched):
            problems.append(f"batch {batch}: {kind} launched outside the last backward")
        if kind == "bucket" and in_backward and launched and not any(e["waiting"] for e in launched):
            problems.append(f"batch {batch}: no bucket launched while others still waited for backward")
    return problems


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("overlap")
    result = launch("overlap_collectives.py", [str(out)], out, world_size=4, timeout_s=500, grace_s=30)
    result.assert_all_succeeded()
    return [json.loads((out / f"overlap_collectives.rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(EXPECTED))
def test_the_reduction_overlaps_the_last_backward_once_per_step(measured: list[dict], layout: str) -> None:
    kind, in_backward = EXPECTED[layout]
    for rank, results in enumerate(measured):
        problems = overlap_problems(results[layout], kind, in_backward, pipelined=layout != "ep2_dp2")
        assert not problems, (rank, layout, problems)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("layout", "like"), [("off_pp2_dp2_1f1b", "pp2_dp2_1f1b"), ("off_zero3_pp2_1f1b", "zero3_pp2_1f1b")]
)
def test_reductions_after_the_schedule_fail_the_check(measured: list[dict], layout: str, like: str) -> None:
    """Negative control: the reductions run after the schedule (the overlap switched off)."""
    kind, in_backward = EXPECTED[like]
    for results in measured:
        problems = overlap_problems(results[layout], kind, in_backward, pipelined=True)
        assert any("after the pipeline schedule" in p or "outside the last backward" in p for p in problems)
