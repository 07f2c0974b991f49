"""The runnable example of docs/experts.md runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "experts.md"


def test_runnable_example_in_the_docs(capsys) -> None:
    text = DOC.read_text()
    section = text.split("## A runnable example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    torch.set_num_threads(1)
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    assert "tensor(" in capsys.readouterr().out
