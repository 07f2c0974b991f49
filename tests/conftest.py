"""Shared pytest configuration.

Markers:
    distributed: starts several CPU processes over gloo through ``tests.distributed.harness``
        (seconds to tens of seconds each). Deselect with ``-m "not distributed"``.
    compat, compat_refused: what a test covers in the compatibility matrix (``tests/compat.py``;
        ``python -m tools.compat_matrix`` reads them to write docs/compatibility.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.optional_packages import use_optional_packages

use_optional_packages()  # torchao from .venv/extras (scripts/setup_env.sh), for the tests that use it

# DeepSpeed's ops as scripts/setup_env.sh built them, in the venv's own cache (inherited by every
# worker the harness starts): sharing ~/.cache/torch_extensions with another checkout recompiles them.
# And the venv's own ninja first on PATH, as an activated venv has it (setup_env.sh activates):
# torch builds an op with the first `ninja` on PATH, and a system ninja of another version reads
# the venv ninja's build log as stale (other hash) and recompiles every op inside the test launches.
_VENV_OPS = Path(sys.prefix) / "torch_extensions"
if _VENV_OPS.is_dir():
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_VENV_OPS))
_VENV_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = os.pathsep.join(filter(None, [_VENV_BIN, os.environ.get("PATH")]))


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "distributed: launches worker processes over gloo (tests/distributed/harness.py); slow"
    )
    config.addinivalue_line(
        "markers",
        "compat(cases=None, features=None): this test asserts parity for the pairs of rows its case(s) hold"
        " (tests/compat.py); without arguments, the case is the test's `case` or `name` parameter",
    )
    config.addinivalue_line(
        "markers",
        "compat_refused(pair, message): this test asserts that the pair of rows is refused with `message`"
        " (put by tests.compat.refusal)",
    )


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """A Trainer run inside pytest (``devices=1``) leaves Lightning's default process group behind;
    tests that fork worker processes would inherit it. Destroy it after every test."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
