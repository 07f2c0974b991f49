"""The GPU check's ``memory`` phase, at its tiny CPU shape: every option runs and the savers engage.

The phase drives the library's savers from outside the strategy (``benchmarks/memory_savers.py``); a rename
inside the saver had made it fail on the lent machine's first call while the suite passed. Here it runs as
the dry run does, and each saver must change what it should: offload moves bytes to the host, compression
stores fewer bytes than it saves, recomputation keeps fewer; and the exact ones leave the gradients as they were.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.tiny_run import tiny_cpu_results


@pytest.mark.timeout(300)
def test_the_memory_phase_runs_every_option_and_each_saver_engages(tmp_path: Path) -> None:
    results = tiny_cpu_results("memory_savers", tmp_path)["results"]
    held = {name: result["bytes"] for name, result in results.items()}
    assert all(result["step_s"] > 0 for result in results.values()), results
    assert held["none"]["offloaded"] == 0 and held["offload"]["offloaded"] > 0
    assert held["full + offload"]["offloaded"] > 0
    for compression in ("bf16 compression", "fp8 compression"):
        assert held[compression]["stored"] < held[compression]["saved"], (compression, held[compression])
    assert held["full"]["total"] < held["none"]["total"]
    # the savers that store activations exactly leave every gradient as it was: here, on the CPU, bit for bit
    from benchmarks.memory_savers import LOSSLESS

    assert all(
        results[name]["gradients_match"] and results[name]["gradient_difference"] == 0 for name in LOSSLESS
    )
    # the negative control: compressed activations change the gradients, and the fingerprint sees it
    for compression in ("bf16 compression", "fp8 compression"):
        assert results[compression]["gradient_difference"] > 1e-3, results[compression]
