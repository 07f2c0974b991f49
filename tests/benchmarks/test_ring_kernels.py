"""The GPU check's ``ring_kernels`` phase at its tiny CPU shape: the blocks' merged output and gradients agree with
torch's attention over the whole sequence (as closely as torch's own bf16 kernel), and the kernel used is named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_ring_kernel_phase_names_the_kernel_and_agrees_with_torch(tmp_path: Path) -> None:
    out = tmp_path / "ring.json"
    subprocess.run([sys.executable, "-m", "benchmarks.ring_kernels", "--tiny", "--cpu", "--repeats", "1", "--json",
                    str(out)], cwd=ROOT, check=True, capture_output=True, timeout=280)  # fmt: skip
    result = json.loads(out.read_text())
    assert result["kernel"] == "torch's fused CPU kernel" and not result["flash_on_gpu"]
    assert result["blocks_vs_exact"] <= 2 * result["torch_bf16_vs_exact"]
    assert result["math_vs_exact"] < result["torch_bf16_vs_exact"]  # fp32 math: closer than any bf16 kernel
