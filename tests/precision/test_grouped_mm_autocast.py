"""Autocast's matmul rule for torch's grouped matmul (Hugging Face's MoE experts), which torch ships without one.

The families' own runs under every layout: tests/distributed/test_zoo.py (and its negative control there).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_parallel.precision import grouped_mm_autocast as rule
from lightning_parallel.precision.plugin import HybridMixedPrecision

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm")


@pytest.fixture
def without_rule() -> Iterator[None]:
    """torch as shipped for the test; the rule as it was after it (other tests' plugins may have registered it)."""
    was = rule.grouped_mm_autocast_registered("cpu")
    rule.unregister_grouped_mm_autocast()
    yield
    rule.unregister_grouped_mm_autocast()
    if was:
        rule.register_grouped_mm_autocast()


def _experts(width: int = 16, hidden: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, width, generator=generator, requires_grad=True)
    weight = torch.randn(
        2, hidden, width, generator=generator, requires_grad=True
    )  # (E, out, in), as transformers
    return rows, weight, torch.tensor([2, 6], dtype=torch.int32)


def _grouped(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offs)  # transformers' _grouped_linear


def test_torch_alone_keeps_grouped_products_in_fp32_under_autocast(without_rule: None) -> None:
    """Why the rule exists (pytorch/pytorch#174763): this is what ran in every MoE family before it."""
    rows, weight, offs = _experts()
    with torch.autocast("cpu", torch.bfloat16):
        assert _grouped(rows, weight, offs).dtype == torch.float32


def test_the_rule_computes_grouped_products_in_the_autocast_dtype(without_rule: None) -> None:
    rule.register_grouped_mm_autocast()
    rule.register_grouped_mm_autocast()  # idempotent
    assert rule.grouped_mm_autocast_registered("cpu")
    rows, weight, offs = _experts()
    exact = _grouped(rows, weight, offs)
    assert exact.dtype == torch.float32  # outside autocast nothing changes
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype):
            out = _grouped(rows, weight, offs)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), exact, rtol=2e-2, atol=5e-2)
    with torch.autocast("cpu", torch.bfloat16):
        out = _grouped(rows, weight, offs)
    out.float().square().sum().backward()
    assert rows.grad is not None and weight.grad is not None
    assert rows.grad.dtype == weight.grad.dtype == torch.float32  # the master weights' gradients stay fp32
    rule.unregister_grouped_mm_autocast()
    with torch.autocast("cpu", torch.bfloat16):
        assert (
            _grouped(rows, weight, offs).dtype == torch.float32
        )  # the negative control: the rule taken away


def test_recomputation_reruns_the_rule(without_rule: None) -> None:
    """Activation checkpointing restores the autocast state, so the recomputed product has the saved one's dtype
    (a rule living in a Python mode would be gone in backward: torch refuses recomputed metadata that differs)."""
    rule.register_grouped_mm_autocast()
    rows, weight, offs = _experts()
    with torch.autocast("cpu", torch.bfloat16):
        out = checkpoint(_grouped, rows, weight, offs, use_reentrant=False)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_widths_the_grouped_kernel_refuses_in_low_precision_keep_their_dtype(without_rule: None) -> None:
    """bf16 rows of 4 values are 8 bytes: the kernel wants 16-byte strides, so the product stays as torch has it."""
    rule.register_grouped_mm_autocast()
    rows, weight, offs = _experts(width=4, hidden=4)
    before = rule.KEPT_WIDE["cpu"]
    with torch.autocast("cpu", torch.bfloat16):
        assert _grouped(rows, weight, offs).dtype == torch.float32
    assert rule.KEPT_WIDE["cpu"] == before + 1


def test_a_mixed_precision_plugin_registers_the_rule(without_rule: None) -> None:
    HybridMixedPrecision("bf16-mixed", "cpu")
    assert rule.grouped_mm_autocast_registered("cpu") and rule.grouped_mm_autocast_registered("cuda")


def test_the_docs_example_runs(tmp_path: Path) -> None:
    section = (
        (ROOT / "docs" / "precision.md")
        .read_text()
        .split("### The experts of Hugging Face's MoE models", 1)[1]
    )
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_kernel_that_refuses_the_low_dtype_keeps_the_operands_dtype(
    without_rule: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU's grouped kernel without fp16, say: the product runs as torch alone would run it, counted."""
    original = torch.ops.aten._grouped_mm

    def refuses_half(mat_a: torch.Tensor, *args: object) -> torch.Tensor:
        if mat_a.dtype == torch.float16:
            raise RuntimeError("no float16 kernel here")
        return original(mat_a, *args)

    rule.register_grouped_mm_autocast()
    rows, weight, offs = _experts()
    before = rule.KEPT_WIDE["cpu"]
    calls = []
    monkeypatch.setattr(
        torch.ops.aten, "_grouped_mm", lambda a, *args: calls.append(a.dtype) or refuses_half(a, *args)
    )
    for _ in range(2):
        with torch.autocast("cpu", torch.float16):
            assert _grouped(rows, weight, offs).dtype == torch.float32
    assert calls == [torch.float16, torch.float32, torch.float32]  # the refusal remembered: tried once
    with torch.autocast("cpu", torch.bfloat16):
        assert _grouped(rows, weight, offs).dtype == torch.bfloat16
    assert rule.KEPT_WIDE["cpu"] == before + 2


def test_running_out_of_memory_is_not_taken_for_a_refusal(
    without_rule: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(*args: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("out of memory")

    rule.register_grouped_mm_autocast()
    monkeypatch.setattr(torch.ops.aten, "_grouped_mm", out_of_memory)
    rows, weight, offs = _experts()
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(torch.OutOfMemoryError):
        _grouped(rows, weight, offs)
