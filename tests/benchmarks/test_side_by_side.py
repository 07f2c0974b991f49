"""``python -m benchmarks.side_by_side`` runs every pair end to end on the smallest settings.

Timed numbers are never asserted (the machine may be loaded): only that each pair ran both sides,
with positive step and setup times and a peak memory, and that the report names every pair beside
its target.
"""

from __future__ import annotations

import math

import pytest

from benchmarks import side_by_side


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_every_pair_runs_and_is_reported() -> None:
    results, pairs, header = side_by_side.measure(
        sorted(side_by_side.GROUPS), "quick", rounds=1, steps=1, warmup=1, micro_batches=(4,), timeout_s=380
    )
    assert set(results) == set(pairs)  # tp, dp x 2, ep, ac x 2, pp x 2 schedules
    for name, measured in results.items():
        (round_,) = measured["rounds"]
        for side in ("reference", "candidate"):
            assert len(round_[side]["step"]) == 1 and round_[side]["step"][0] > 0, (name, side)
            assert 0 < round_[side]["setup"][0] < round_[side]["first_step"][0], (name, side)
            assert math.isfinite(measured["peak_rss_mb"][side]), (name, side)
    text = side_by_side.report(results, pairs, header)
    for name, pair in pairs.items():
        assert f"| {name} " in text and (pair.target is None or f"<= {pair.target}" in text), name
