"""The environment variables a launcher sets, in one place: tests that start processes remove them.

A test process may itself run under a launcher (torchrun, SLURM, Lightning's own re-launch); its
children must not inherit that world's ranks and rendezvous, or they would join it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)
SCHEDULER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_", "PL_")
ROOT = Path(__file__).resolve().parents[1]


def without_launcher(
    env: Mapping[str, str] | None = None, prefixes: tuple[str, ...] = SCHEDULER_PREFIXES
) -> dict[str, str]:
    """``env`` (default: this process's) without launcher variables and scheduler-prefixed ones."""
    source = os.environ if env is None else env
    return {k: v for k, v in source.items() if k not in LAUNCHER_VARIABLES and not k.startswith(prefixes)}


def worker_environment() -> dict[str, str]:
    """What every process a test launches starts from: this process's environment without launcher
    variables, the project importable, one thread, unbuffered output, and Hugging Face offline. The same
    for every launcher, so a pre-imported worker server (tests/warm_workers.py) fits all of them."""
    env = without_launcher()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # fmt: skip
    return env


def release_build_locks() -> list[Path]:
    """Remove the lock files of torch's JIT extension builds (DeepSpeed's ops) that killed ranks left behind.

    Every rank that loads an op takes its build folder's ``lock`` for the moment torch checks the build, and
    a rank killed in that moment (a timeout, or a test's fault injection killing the others) never removes
    it: every later rank loading the op then waits on it for ever (the fresh-clone CI hung in
    ``test_zero_collectives`` so). Called by the launchers right after they kill a launch's ranks: the tests
    run one launch at a time, so no rank of theirs is loading at that moment. Returns what it removed.
    """
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ""))
    if not root.name or not root.is_dir():
        return []
    removed = []
    for lock in root.glob("*/lock"):
        try:
            lock.unlink()
            removed.append(lock)
        except FileNotFoundError:
            pass
    return removed
