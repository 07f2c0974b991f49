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

# DeepSpeed's ops, built once before the first test (pytest_sessionstart below), in the venv's own
# cache (inherited by every worker the harness starts): sharing ~/.cache/torch_extensions with
# another checkout recompiles them.
# And the venv's own ninja first on PATH, as an activated venv has it (setup_env.sh activates):
# torch builds an op with the first `ninja` on PATH, and a system ninja of another version reads
# the venv ninja's build log as stale (other hash) and recompiles every op inside the test launches.
_VENV_OPS = Path(sys.prefix) / "torch_extensions"
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_VENV_OPS))
_VENV_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = os.pathsep.join(filter(None, [_VENV_BIN, os.environ.get("PATH")]))


_OPS_READY = ".built"  # written when every op this machine can build is built and loads without a rebuild


def _deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def pytest_sessionstart(session) -> None:
    """Build DeepSpeed's C++ ops before the first test, once per venv, so no test compiles inside a
    timed launch (``scripts/setup_env.sh`` builds nothing: the README's main job needs none of them)."""
    ops = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if not _deepspeed_installed() or (ops / _OPS_READY).exists():
        return
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "build_deepspeed_ops.py"
    writer = session.config.get_terminal_writer()
    writer.line(
        f"tests: building DeepSpeed's C++ ops once into {ops} (CPU Adam, shared-memory comm, async I/O, pinned"
        " memory: the ZeRO and offload tests load them; minutes: 3.5 measured on 2 cores; seconds once built)"
    )
    ops.mkdir(parents=True, exist_ok=True)
    for extra in ([], ["--check"]):
        result = subprocess.run([sys.executable, str(script), *extra], capture_output=True, text=True)
        if result.returncode != 0:
            raise pytest.UsageError(
                f"building DeepSpeed's ops failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        writer.line(result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "")
    (ops / _OPS_READY).write_text("built and checked by scripts/build_deepspeed_ops.py\n")


def pytest_configure(config) -> None:
    from tests.compat_results import register

    register(config)  # LP_COMPAT_RESULTS=<file>: the passed coverage tests, for tools/compat_matrix.py
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
    config.addinivalue_line(
        "markers",
        "zoo(family, layout, refused=None): this test trains a family of tests/models/zoo.py in `layout` at parity,"
        " or asserts that the layout is refused with `refused` (docs/compatibility.md, 'Model families')",
    )


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """A Trainer run inside pytest (``devices=1``) leaves Lightning's default process group behind;
    tests that fork worker processes would inherit it. Destroy it after every test."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
