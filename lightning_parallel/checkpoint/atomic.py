"""Atomic checkpoint writes: a crash during a save never damages the last good checkpoint.

A sharded checkpoint is a folder that every rank writes into, and ``ModelCheckpoint`` writes
``last.ckpt`` under the same name at every save. Written in place, a rank that dies half-way
leaves a folder mixing the old and the new step (``torch.distributed.checkpoint`` warns that
it overwrites in place). So every save goes to ``.lightning_parallel/<name>.partial`` next to it; only when
all ranks have finished (the folder is complete once rank 0 has written Lightning's
``meta.pt``, which it does after ``torch.distributed.checkpoint.save`` returned, that is after
every rank's shard is on disk) does rank 0 move it into place:

1. ``<name>`` -> ``.lightning_parallel/<name>.previous`` (if a checkpoint is there), one ``rename``;
2. ``.lightning_parallel/<name>.partial`` -> ``<name>``, one ``rename``;
3. delete ``<name>.previous`` (and the hidden folder once empty).

At every instant either ``<name>`` is a complete checkpoint, or (between 1 and 2) both hidden
copies are; :func:`recover` puts the newest complete one back under ``<name>`` before a load,
so ``Trainer(ckpt_path=...)`` finds it. The hidden folder's name holds neither ``.ckpt`` nor
``ckpt_``, so Lightning's searches of the folder (``ckpt_path="last"``, the SLURM requeue's
``hpc_ckpt_<n>``) never mistake an unfinished save for a checkpoint.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from lightning_parallel.compat import METADATA_FILENAME

__all__ = ["commit", "is_complete", "previous_path", "recover", "remove", "staging_path"]


HIDDEN = ".lightning_parallel"


def staging_path(path: Path) -> Path:
    return path.parent / HIDDEN / f"{path.name}.partial"


def previous_path(path: Path) -> Path:
    return path.parent / HIDDEN / f"{path.name}.previous"


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def is_complete(path: Path) -> bool:
    """A consolidated file, or a sharded folder with both its metadata files (written last)."""
    if path.is_file():
        return True
    return path.is_dir() and (path / METADATA_FILENAME).is_file() and (path / ".metadata").is_file()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush a written checkpoint to disk before it replaces the last good one."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb+") as handle:
            os.fsync(handle.fileno())
    if path.is_dir():
        _fsync_dir(path)


def commit(staging: Path, path: Path) -> None:
    """Rank 0, after every rank finished writing ``staging``: move it to ``path`` (steps 1-3 above)."""
    previous = previous_path(path)
    fsync_tree(staging)
    if path.exists() or path.is_symlink():
        remove(previous)  # left by an earlier crash; ``path`` is the good one then
        os.rename(path, previous)
    os.rename(staging, path)
    _fsync_dir(path.parent)
    remove(previous)
    try:
        staging.parent.rmdir()  # only when empty: no other save in progress or left behind
    except OSError:
        pass


def recover(path: Path, log: Callable[[str], None] = print) -> None:
    """Rank 0, before a load: if a crash came between steps 1 and 2, finish the move (or undo it)."""
    if path.exists():
        return
    for candidate in (staging_path(path), previous_path(path)):
        if is_complete(candidate):
            os.rename(candidate, path)
            log(
                f"{path}: a save was interrupted while replacing it; restored the complete copy {candidate.name}."
            )
            return
