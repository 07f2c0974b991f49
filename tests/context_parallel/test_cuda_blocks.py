"""The ring's GPU blocks (torch's CUDA flash kernel), run here through a stand-in with the CUDA ops' signatures.

The stand-in answers ``aten._scaled_dot_product_flash_attention`` and its backward, with their schemas' arguments,
by torch's fused CPU kernel, and the blocks are taken for a GPU's (``flash_takes`` answers yes on the CPU): the
dispatch, the bookkeeping between forward and backward and the merge of two blocks run as they will on a GPU,
against ``F.scaled_dot_product_attention`` over the whole sequence. The check made at first use sends a wrong
kernel back to the math, with a warning. On a GPU: ``benchmarks/ring_kernels.py`` (the GPU check).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks.ring_kernels import two_ring_blocks, whole_sequence
from lightning_parallel.context_parallel import cuda_blocks, ring
from lightning_parallel.context_parallel.blocks import Block

_cpu = torch.ops.aten


class _FlashStandIn:
    """The two CUDA ops with their schemas' argument lists, computed by the CPU kernel (``scale_error``: a wrong one)."""

    def __init__(self, scale_error: float = 1.0) -> None:
        self.scale_error, self.calls = scale_error, 0

    def _scaled_dot_product_flash_attention(
        self, query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False,
        return_debug_mask: bool = False, *, scale: float | None = None,
    ) -> tuple:  # fmt: skip
        self.calls += 1
        out, lse = _cpu._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, scale=scale * self.scale_error
        )
        rows, columns = query.shape[-2], key.shape[-2]
        return (
            out,
            lse,
            None,
            None,
            rows,
            columns,
            torch.empty(2, dtype=torch.int64),
            torch.empty(0),
            torch.empty(0),
        )

    def _scaled_dot_product_flash_attention_backward(
        self, grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, cum_seq_q: Any,
        cum_seq_k: Any, max_q: int, max_k: int, dropout_p: float, is_causal: bool, philox_seed: Any,
        philox_offset: Any, *, scale: float | None = None,
    ) -> tuple:  # fmt: skip
        assert (max_q, max_k) == (
            query.shape[-2],
            key.shape[-2],
        ) and cum_seq_q is None  # what the forward gave
        return _cpu._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale
        )


def test_the_stand_in_has_the_cuda_ops_arguments() -> None:
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"):
        schema = [argument.name for argument in getattr(torch.ops.aten, name).default._schema.arguments]
        assert list(inspect.signature(getattr(_FlashStandIn, name)).parameters)[1:] == schema


@pytest.fixture
def as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[_FlashStandIn]:
    kernels = _FlashStandIn()
    monkeypatch.setattr(cuda_blocks, "_aten", kernels)
    monkeypatch.setattr(ring, "fused", lambda device: False)  # not the CPU kernel's branch
    monkeypatch.setattr(ring, "flash_takes", lambda q, bias: bias is None and q.dtype == torch.bfloat16)
    monkeypatch.setattr(ring, "_AGREE", {})
    yield kernels


def _qkvg(length: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, 4, length, 64, generator=generator).bfloat16() for _ in range(4)]


def test_two_blocks_merge_to_attention_over_the_whole_sequence(as_on_a_gpu: _FlashStandIn) -> None:
    """The two blocks a rank of a two-rank ring computes for the second half of a causal sequence (the GPU
    check's ``ring_kernels`` phase computes them the same way), against torch's attention over the whole of it."""
    q, k, v, grad = _qkvg()
    out, dq, dk, dv = two_ring_blocks(q, k, v, grad)
    assert as_on_a_gpu.calls == 2 + 2  # the two blocks, and the first use's check (causal and not)
    whole = whole_sequence(*(t.float() for t in (q, k, v, grad)))
    torch.testing.assert_close(out, whole[0], atol=2e-2, rtol=2e-2)
    for got, want in zip((dq, dk, dv), whole[1:], strict=True):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_a_kernel_that_disagrees_with_the_math_is_not_used(
    as_on_a_gpu: _FlashStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_blocks, "_aten", _FlashStandIn(scale_error=1.5))
    q, k, v, _ = _qkvg()
    with pytest.warns(UserWarning, match="fp32 math, not with torch's flash kernel.*output of a full block"):
        out, _ = ring._attend(q, k, v, Block(0, 0, False), 64**-0.5)
    assert out.dtype == torch.float32 and ring._AGREE == {("cpu", torch.bfloat16, 64): False}
    exact, _ = ring._math_attend(q, k, v, Block(0, 0, False), 64**-0.5)
    torch.testing.assert_close(out, exact)  # the math computed it


def test_blocks_the_flash_kernel_cannot_take_keep_the_math() -> None:
    q = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    assert not cuda_blocks.flash_takes(q, None)  # not on a GPU
    assert not cuda_blocks.flash_takes(q.float(), None) and not cuda_blocks.flash_takes(q, torch.zeros(8, 8))


def test_a_backward_the_kernel_refuses_is_computed_by_the_math(
    as_on_a_gpu: _FlashStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chip whose flash backward refuses a head width the check did not meet: the math needs only the final
    output and log-sum-exp, so the block's gradients are still right, and later blocks go to the math at once."""
    q, k, v, grad = _qkvg()
    block, scale = Block(0, 0, True), 64**-0.5
    out, lse = ring._attend(q, k, v, block, scale)  # checked and agreed: the kernel's forward

    def refuses(*args: Any, **kwargs: Any) -> tuple:
        raise RuntimeError("FlashAttention backward for head dim > 192 requires A100/A800 or H100/H800")

    monkeypatch.setattr(as_on_a_gpu, "_scaled_dot_product_flash_attention_backward", refuses)
    with pytest.warns(UserWarning, match="flash backward refused a block"):
        found = ring._attend_backward(grad, q, k, v, out.bfloat16(), lse, block, scale)
    expected = ring._math_backward(grad, q, k, v, out.bfloat16(), lse, block, scale)
    for got, want in zip(found, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert not ring._flash_on_gpu(q, block)  # remembered for this width
