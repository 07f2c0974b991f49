"""The environment variables a launcher sets, in one place: tests that start processes remove them.

A test process may itself run under a launcher (torchrun, SLURM, Lightning's own re-launch); its
children must not inherit that world's ranks and rendezvous, or they would join it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
SCHEDULER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_")


def without_launcher(
    env: Mapping[str, str] | None = None, prefixes: tuple[str, ...] = SCHEDULER_PREFIXES
) -> dict[str, str]:
    """``env`` (default: this process's) without launcher variables and scheduler-prefixed ones."""
    source = os.environ if env is None else env
    return {k: v for k, v in source.items() if k not in LAUNCHER_VARIABLES and not k.startswith(prefixes)}
