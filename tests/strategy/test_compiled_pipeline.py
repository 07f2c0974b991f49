"""``compile=True`` under pipeline stages (CPU inductor), with full and selective recomputation and with
two stages per rank (interleaved 1F1B, where each block's forward is gated by the active stage): the
losses and the parameters after three steps are the eager pipeline's, and every block this rank holds
really ran compiled (dynamo made graphs). Before, recomputation under stages passed dynamo a context
that is not a dispatch mode and compilation failed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.strategy import launch_for_results

pytestmark = [pytest.mark.distributed]


@pytest.mark.timeout(900)
def test_a_compiled_pipeline_step_trains_like_the_eager_one(tmp_path: Path) -> None:
    for rank, measured in enumerate(launch_for_results("compiled_pipeline.py", tmp_path)):
        for mode, seen in measured.items():
            eager = measured["eager_interleaved" if "interleaved" in mode else "eager"]
            if mode.startswith("compiled"):
                assert seen["compiled_blocks"] == seen["held_blocks"] >= 1 and seen["graphs"] >= 1, (
                    rank,
                    mode,
                )
            else:
                assert seen["compiled_blocks"] == 0 and seen["graphs"] == 0, (rank, mode)
            for a, b in zip(seen["losses"], eager["losses"], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (rank, mode, seen["losses"], eager["losses"])
            assert abs(seen["parameters"] - eager["parameters"]) <= 1e-5 * eager["parameters"], (rank, mode)
        # the data moved the loss by far more than the tolerance (the comparison can fail)
        first, last = measured["eager"]["losses"][0], measured["eager"]["losses"][-1]
        assert abs(first - last) > 100 * 1e-5 * abs(first)
