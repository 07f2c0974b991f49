"""The runnable examples of docs/planner.md run as printed (the Trainer is built, not fitted: that takes ranks)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


def test_every_python_example_runs(capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 2
    torch.set_num_threads(1)
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert "tokens/s" in out  # the step-time example printed its prediction
