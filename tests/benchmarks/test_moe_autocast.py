"""The GPU check's ``moe_autocast`` phase at its tiny CPU shape: torch alone keeps the experts in fp32, the rule
computes them in bf16 (the phase's figures read exactly these)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.tiny_run import tiny_cpu_results


@pytest.mark.timeout(300)
def test_the_moe_phase_shows_the_experts_dtype_with_and_without_the_rule(tmp_path: Path) -> None:
    result = tiny_cpu_results("moe_autocast", tmp_path, "--steps", "1")
    alone, ruled = result["configs"]["torch autocast alone"], result["configs"]["with the grouped rule"]
    assert set(alone["grouped"]) == {"float32"} and set(ruled["grouped"]) == {"bfloat16"}
    assert result["bf16_share"] == 1.0 and result["rule_over_alone"] > 0
    assert result["first_loss_diff"] < 1e-2  # the same model and batch, in bf16 rounding
