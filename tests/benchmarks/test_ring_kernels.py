"""The GPU check's ``ring_kernels`` phase at its tiny CPU shape: the blocks' merged output and gradients agree with
torch's attention over the whole sequence (as closely as torch's own bf16 kernel), and the kernel used is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.tiny_run import tiny_cpu_results


@pytest.mark.timeout(300)
def test_the_ring_kernel_phase_names_the_kernel_and_agrees_with_torch(tmp_path: Path) -> None:
    result = tiny_cpu_results("ring_kernels", tmp_path, "--repeats", "1")
    assert result["kernel"] == "torch's fused CPU kernel" and not result["flash_on_gpu"]
    assert result["blocks_vs_exact"] <= 2 * result["torch_bf16_vs_exact"]
    assert result["math_vs_exact"] < result["torch_bf16_vs_exact"]  # fp32 math: closer than any bf16 kernel
