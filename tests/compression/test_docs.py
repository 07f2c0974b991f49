"""The runnable example of docs/compression.md runs as printed (2 CPU processes, Lightning's launcher)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.environment import ROOT, worker_environment

DOC = ROOT / "docs" / "compression.md"


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_runnable_example_in_the_docs(tmp_path: Path) -> None:
    section = DOC.read_text().split("## A runnable example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "compression_example.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=worker_environment(), capture_output=True,
                         text=True, timeout=200)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    match = re.search(r"pruned (\d+) of (\d+) weights; kd_loss (\d+\.\d+)", run.stdout)
    assert match, run.stdout[-2000:]
    pruned, selected, kd = int(match[1]), int(match[2]), float(match[3])
    assert pruned == selected // 2 and kd > 0
