"""A ZeRO fit on DeepSpeed's engine lets go of the engine, the module and the Trainer once they are dropped.

DeepSpeed keeps every engine for the life of the process (ZeRO-1/2: hooks on the parameters' gradient
accumulators, which Python's collector cannot see through; ZeRO-3: a module-level stack and a class-level
cache holding the module). On the lent H200 a ZeRO-1 fit left 19.6 GiB allocated after its Trainer and
module were deleted, and every later phase of the GPU check started that much fuller. The strategy releases
those references when a Trainer call ends (``zero/engine.py: release_engine``); a checkpoint saved after
``fit`` still holds the model and the optimizer states. Negative control: without the release, DeepSpeed's
own references keep the engine, the module and the Trainer alive at every stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.strategy import launch_for_results

pytestmark = [pytest.mark.distributed]


@pytest.mark.timeout(600)
def test_nothing_of_a_zero_fit_outlives_its_trainer(tmp_path: Path) -> None:
    for rank, result in enumerate(launch_for_results("zero_release.py", tmp_path)):
        for stage, held in result.items():
            where = f"ZeRO-{stage} rank {rank}: {held}"
            assert not held["engine_alive"] and not held["module_alive"] and not held["trainer_alive"], where
            assert held["checkpoint_bytes"] > 0, where


@pytest.mark.timeout(600)
def test_without_the_release_deepspeed_keeps_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LP_KEEP_ENGINE", "1")
    for rank, result in enumerate(launch_for_results("zero_release.py", tmp_path)):
        for stage, held in result.items():
            assert held["engine_alive"] and held["module_alive"] and held["trainer_alive"], (
                stage,
                rank,
                held,
            )
