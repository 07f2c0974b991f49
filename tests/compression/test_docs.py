"""The runnable example of docs/compression.md runs as printed (2 CPU processes, Lightning's launcher)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_examples import run_doc_example
from tests.environment import ROOT


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_runnable_example_in_the_docs(tmp_path: Path) -> None:
    out = run_doc_example(ROOT / "docs" / "compression.md", tmp_path)
    match = re.search(r"pruned (\d+) of (\d+) weights; kd_loss (\d+\.\d+)", out)
    assert match, out[-2000:]
    pruned, selected, kd = int(match[1]), int(match[2]), float(match[3])
    assert pruned == selected // 2 and kd > 0
