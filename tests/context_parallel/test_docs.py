"""The runnable example of docs/context_parallel.md runs as printed (2 CPU processes, Lightning's launcher)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doc_examples import run_doc_example
from tests.environment import ROOT


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_runnable_example_in_the_docs(tmp_path: Path) -> None:
    out = run_doc_example(ROOT / "docs" / "context_parallel.md", tmp_path)
    assert re.search(r"context ranks: 2 loss: \d+\.\d+", out), out[-2000:]
