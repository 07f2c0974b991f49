"""Run the first Python block under a page's "## A runnable example" heading (or another) as a script, as a reader would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.environment import ROOT, worker_environment


def run_doc_example(
    doc: Path, tmp_path: Path, timeout_s: float = 200, heading: str = "## A runnable example"
) -> str:
    """The example's stdout (the first Python block under ``heading``); fails with its output if it exits non-zero."""
    section = doc.read_text().split(heading, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"{doc.name}: no python block under {heading!r}"
    script = tmp_path / f"{doc.stem}_example.py"
    script.write_text(match.group(1))
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=worker_environment(), capture_output=True,
                         text=True, timeout=timeout_s)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout
