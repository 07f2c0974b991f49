"""The launchers' clean-up after a kill: torch's build locks a killed rank left do not stall the next launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.environment import release_build_locks


def test_locks_left_by_killed_ranks_are_released(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for op in ("cpu_adam", "shm_comm"):
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").write_text("")
        (tmp_path / op / f"{op}.so").write_text("")  # negative control: the built op stays
    removed = release_build_locks()
    assert sorted(p.parent.name for p in removed) == ["cpu_adam", "shm_comm"]
    assert not list(tmp_path.glob("*/lock"))
    assert sorted(p.name for p in tmp_path.glob("*/*.so")) == ["cpu_adam.so", "shm_comm.so"]
    assert release_build_locks() == []  # nothing left to release


def test_without_an_extensions_folder_nothing_is_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert release_build_locks() == []
