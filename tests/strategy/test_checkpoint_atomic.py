"""Atomic checkpoint writes: a save that crashes half-way never damages the last good checkpoint.

Two launches of ``scripts/checkpoint_atomic.py`` (tp=2, 2 ranks, ``ModelCheckpoint`` overwriting
``last.ckpt`` every 2 steps): the first breaks the save of step 4 with a raised error and with a
killed rank, the second resumes ``last.ckpt`` (step 2) of both in fresh processes; the rest of the
run must be the uninterrupted one, bit for bit. The move into place is also checked without
processes at each point a crash can interrupt it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_parallel.checkpoint import atomic
from tests.strategy import launch


def _read(out: Path, run: str) -> list[dict]:
    return [json.loads((out / f"{run}.rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_crash_during_a_save_leaves_the_last_checkpoint_resumable(tmp_path: Path) -> None:
    crash = launch("checkpoint_atomic.py", ["crash", str(tmp_path)], tmp_path, timeout_s=300, grace_s=90)
    print(f"crash launch: {crash.wall_s:.1f} s")
    killed = crash.ranks[1]
    assert killed.returncode == -9, crash.summary()  # rank 1 SIGKILLed itself inside the writer
    survivor = json.loads((tmp_path / "kill.rank0.json").read_text())  # rank 0 noticed: its fit failed
    assert survivor["global_step"] == 4 and survivor["error"], survivor
    for raised in _read(tmp_path, "raise"):
        assert raised["global_step"] == 4 and "No space left on device" in str(raised["error"]), raised
    for fault in ("raise", "kill"):
        meta = torch.load(tmp_path / fault / "last.ckpt" / "meta.pt", weights_only=True)
        assert meta["global_step"] == 2, f"{fault}: last.ckpt holds step {meta['global_step']}"

    resume = launch("checkpoint_atomic.py", ["resume", str(tmp_path)], tmp_path, timeout_s=300)
    print(f"resume launch: {resume.wall_s:.1f} s")
    resume.assert_all_succeeded()
    straight = _read(tmp_path, "straight")
    for fault in ("raise", "kill"):
        for rank, resumed in enumerate(_read(tmp_path, f"resumed_{fault}")):
            assert resumed["global_step"] == 6 and resumed["error"] is None, resumed
            assert resumed["batches"] == straight[rank]["batches"][2:], f"{fault}, rank {rank}: data order"
            assert resumed["losses"] == straight[rank]["losses"][2:], (
                f"{fault}, rank {rank}: {resumed['losses']} vs {straight[rank]['losses'][2:]}"
            )
        # The resumed run saved over the leftovers of the broken save.
        meta = torch.load(tmp_path / fault / "last.ckpt" / "meta.pt", weights_only=True)
        assert meta["global_step"] == 6
        assert sorted(p.name for p in (tmp_path / fault).iterdir()) == ["last.ckpt"]


def _checkpoint(path: Path, step: int) -> Path:
    path.mkdir(parents=True)  # a sharded checkpoint as far as the move is concerned
    torch.save({"global_step": step}, path / "meta.pt")
    (path / ".metadata").write_bytes(b"dcp")
    return path


def _step(path: Path) -> int:
    return torch.load(path / "meta.pt", weights_only=True)["global_step"]


@pytest.mark.parametrize("crash_after", ["written", "moved_old_away", "moved_new_in"])
def test_each_point_of_the_move_into_place_leaves_a_complete_checkpoint(
    tmp_path: Path, crash_after: str
) -> None:
    """``commit`` is two renames and a delete; wherever a crash stops it, ``recover`` finds a whole
    checkpoint under the name (the new one once it is complete, else the old one)."""
    path = _checkpoint(tmp_path / "last.ckpt", 2)
    _checkpoint(atomic.staging_path(path), 4)
    if crash_after in ("moved_old_away", "moved_new_in"):
        path.rename(atomic.previous_path(path))
    if crash_after == "moved_new_in":
        atomic.staging_path(path).rename(path)
    atomic.recover(path, log=lambda _: None)
    assert _step(path) == (2 if crash_after == "written" else 4)
    atomic.remove(atomic.staging_path(path))  # the next save starts by removing what a crash left
    atomic.commit(_checkpoint(atomic.staging_path(path), 6), path)
    assert _step(path) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_an_incomplete_save_is_never_restored(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    staging = atomic.staging_path(path)
    staging.mkdir(parents=True)
    (staging / "__0_0.distcp").write_bytes(b"half")  # no metadata: the writers did not finish
    atomic.recover(path, log=lambda _: None)
    assert not path.exists()
