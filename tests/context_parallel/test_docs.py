"""The runnable example of docs/context_parallel.md runs as printed (2 CPU processes, Lightning's launcher)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.environment import ROOT, worker_environment

DOC = ROOT / "docs" / "context_parallel.md"


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_runnable_example_in_the_docs(tmp_path: Path) -> None:
    section = DOC.read_text().split("## A runnable example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "cp_example.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=worker_environment(), capture_output=True,
                         text=True, timeout=200)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"context ranks: 2 loss: \d+\.\d+", run.stdout), run.stdout[-2000:]
