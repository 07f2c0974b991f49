"""A benchmark of the GPU check run at its tiny CPU shape, as the dry run runs it: its JSON results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def tiny_cpu_results(module: str, folder: Path, *args: str) -> dict[str, Any]:
    """``python -m benchmarks.<module> --tiny --cpu <args> --json ...`` in a subprocess; fails with its output."""
    out = folder / f"{module}.json"
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--tiny", "--cpu", *args, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())
