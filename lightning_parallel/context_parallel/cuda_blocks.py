"""The ring's blocks on a GPU: torch's flash attention kernel and its backward, where the block allows it.

On the CPU each block runs torch's fused CPU kernel (``ring.py``). On a GPU the blocks had only the
math written out in fp32: every product of the attention in fp32 where the user asked for bf16, and
the scores of a block materialised. torch's flash kernel for CUDA returns the log-sum-exp the ring's
merge needs and takes the final output and log-sum-exp in its backward, as the CPU kernel does; it
runs fp16 and bf16, heads up to 256 wide (a multiple of 8), no additive mask (causal within a block
is its own flag). A block with a mask, or another dtype, keeps the math.

No GPU runs this project's CI, so the kernels are checked where they run: the first block of a
process on each (device, dtype, head width) is computed both ways on a small problem, forward and
backward, and the kernel is used only if it agrees with the math (``ring.py``: ``cuda_kernels_agree``);
otherwise the math, with a warning that says why (as for a backward the kernel refuses later). The GPU check measures which ran (``benchmarks/ring_kernels.py``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["flash_block", "flash_block_backward", "flash_takes"]

_aten = torch.ops.aten
_AUX: dict[str, tuple[Any, ...]] = {}
"""What the forward kernel last returned on a device besides output, log-sum-exp and lengths: its backward takes
them back (sequence offsets of packed batches, None here; the random state, unused at a dropout of 0)."""


def flash_takes(q: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether torch's CUDA flash kernel can compute this block (dtype, head width, no additive mask)."""
    return (
        q.device.type == "cuda"
        and bias is None
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    )


def flash_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output (in q's dtype) and log-sum-exp (fp32, ``(B, H, rows)``)."""
    out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = _aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale
    )
    _AUX[str(q.device)] = (cum_q, cum_k, rng, unused)
    return out, lse


def flash_block_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's part of dq, dk, dv given the FINAL output (q's dtype) and log-sum-exp of its queries."""
    cum_q, cum_k, rng, unused = _AUX[str(q.device)]
    max_q, max_k = q.shape[-2], k.shape[-2]
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        grad.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
        lse.float().contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale,
    )  # fmt: skip
    return dq, dk, dv
