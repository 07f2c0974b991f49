"""A lost rank ends the whole job with an error, quickly; a damaged checkpoint is refused, not loaded.

Two ranks through the real Trainer (``tests/strategy/scripts/faults.py``). The strategy's
collective timeout stays at its 15-minute default: the job must end because the dead rank's
connections close, within 60 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.strategy import launch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

BOUND_S = 60


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_killing_one_rank_ends_the_job_with_an_error(layout: str, tmp_path: Path) -> None:
    started = time.time()
    result = launch("faults.py", ["kill-rank", layout, str(tmp_path)], tmp_path, timeout_s=180, grace_s=150)
    ended = started + result.wall_s
    killed_at = float((tmp_path / "killed_at").read_text())
    survivor = result.ranks[0]
    assert not survivor.killed, f"rank 0 hung and had to be killed:\n{result.summary()}"
    assert survivor.returncode not in (0, None), f"rank 0 did not fail:\n{result.summary()}"
    assert "fit finished" not in survivor.output
    print(f"{layout}: rank 0 ended {ended - killed_at:.1f} s after rank 1 was killed")
    assert ended - killed_at < BOUND_S, f"{ended - killed_at:.1f} s:\n{result.summary()}"


def test_a_truncated_checkpoint_is_reported_and_not_loaded(tmp_path: Path) -> None:
    result = launch("faults.py", ["corrupt-checkpoint", str(tmp_path)], tmp_path, timeout_s=180, grace_s=60)
    outputs = "\n".join(r.output for r in result.ranks)
    assert all(r.returncode not in (0, None) for r in result.ranks), result.summary()
    assert "fit finished" not in outputs
    assert "is damaged or incomplete" in outputs and "so it was not loaded" in outputs, result.summary()
