"""Ring attention: each rank's queries meet every rank's keys and values as they rotate around the ring.

With ``C`` ranks, the keys and values of this rank's tokens travel ``C - 1`` hops (one chunk per
hop, sent while the previous one is being used); at each hop the local queries attend to the
visiting chunk, block by block (``blocks.py``: masked-out blocks are skipped, so every rank does
the same work), and the partial results are merged by their log-sum-exp (the online softmax of
flash attention, across ranks). What is saved for backward is this rank's queries, keys, values,
output and log-sum-exp; nothing of the whole sequence is computed at once (a mask the model made
for the whole sequence is kept as it is and cut per block, and the math path of other devices
holds one block's scores, ``B x H x (T/2C)^2``, at a time).

Backward rotates the keys and values again, with their gradients travelling beside them: each
rank adds what its queries contribute to the visiting chunk's gradient and passes it on; after
``C`` hops every chunk's gradient is back with its owner. Each block's backward is given the
final output and log-sum-exp, which is what makes the sum of the blocks' gradients exact.

Each block runs torch's fused flash kernel for the CPU (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward: the kernel ``F.scaled_dot_product_attention`` itself runs on the CPU, which
returns the log-sum-exp the merge needs); on a GPU torch's flash kernel for CUDA, where the block
allows it and it agreed with the math when first used (``cuda_blocks.py``); otherwise the same math
written out in fp32.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.context_parallel.blocks import Block, ChunkPairs
from lightning_parallel.context_parallel.cuda_blocks import flash_block, flash_block_backward, flash_takes
from lightning_parallel.context_parallel.traffic import TRAFFIC

Partial = tuple[torch.Tensor, torch.Tensor]  # (output, log-sum-exp) of some keys


class _Exchange:
    """One hop: send tensors to the next rank, receive the previous rank's into new buffers."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        send_to = dist.get_global_rank(group, (rank + 1) % size)
        receive_from = dist.get_global_rank(group, (rank - 1) % size)
        self._shapes = [t.shape for t in tensors]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._buffer = torch.empty_like(flat)
        TRAFFIC.add("ring", flat.numel() * flat.element_size())
        self._requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, flat, send_to, group),
                dist.P2POp(dist.irecv, self._buffer, receive_from, group),
            ]
        )
        self._sent = flat  # kept alive until the send completes

    def wait(self) -> tuple[torch.Tensor, ...]:
        for request in self._requests:
            request.wait()
        out, start = [], 0
        for shape in self._shapes:
            numel = shape.numel()
            out.append(self._buffer[start : start + numel].view(shape))
            start += numel
        return tuple(out)


def fused(device: torch.device) -> bool:
    """Whether blocks run torch's fused CPU kernel (the math fallback elsewhere; tests switch it off to check both)."""
    return device.type == "cpu"


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``groups`` consecutive query heads."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: summed over the query heads a key/value head served."""
    if groups == 1:
        return grad
    b, h, t, d = grad.shape
    return grad.view(b, h // groups, groups, t, d).sum(2)


def _math_bias(block: Block, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    bias = None if block.bias is None else block.bias.float()
    if block.causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        causal = torch.zeros(future.shape, device=q.device).masked_fill(future, float("-inf"))
        bias = causal if bias is None else bias + causal
    return bias


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    p = torch.exp(scores - lse.unsqueeze(-1))
    return torch.where(torch.isfinite(lse).unsqueeze(-1), p, torch.zeros_like(p))  # rows with no key: 0


def _scores(q: torch.Tensor, k: torch.Tensor, block: Block, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    bias = _math_bias(block, q, k)
    return scores if bias is None else scores + bias


def _math_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float) -> Partial:
    scores = _scores(q, k, block, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(_probabilities(scores, lse), v.float()), lse


def _flash_on_gpu(q: torch.Tensor, block: Block) -> bool:
    return flash_takes(q, block.bias) and cuda_kernels_agree(q.device, q.dtype, q.shape[-1])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, scale: float) -> Partial:
    """One block's attention: output (fp32) and log-sum-exp (minus infinity for rows with no key)."""
    if fused(q.device):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, block.causal, attn_mask=block.bias, scale=scale
        )
        out = out.float()
    elif _flash_on_gpu(q, block):
        out, lse = flash_block(q, k, v, block.causal, scale)
        out = out.float()
    else:
        out, lse = _math_attend(q, k, v, block, scale)
    if block.has_key is not None:
        lse = torch.where(block.has_key, lse, torch.full_like(lse, float("-inf")))
        out = torch.where(block.has_key.unsqueeze(-1), out, torch.zeros_like(out))
    return out, lse


def _attend_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's part of dq, dk, dv, given the FINAL output and log-sum-exp of the queries."""
    if fused(q.device):
        # Rows with no key anywhere have lse = -inf (output 0); the kernel would make exp(-inf + inf) = NaN of
        # them, and NaN reaches dk, dv through p^T grad. Its own forward keeps 0 for such rows: so do we here.
        lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, block.causal, attn_mask=block.bias, scale=scale
        )
    if _flash_on_gpu(q, block):
        try:
            return flash_block_backward(grad, q, k, v, out, lse, block.causal, scale)
        except (torch.OutOfMemoryError, torch.AcceleratorError):
            raise
        except RuntimeError as error:
            # the math needs only the final output and log-sum-exp: valid after any forward
            _AGREE[(str(q.device), q.dtype, q.shape[-1])] = False
            warnings.warn(f"Context parallelism: torch's flash backward refused a block ({error}); the math computes it.",
                          stacklevel=2)  # fmt: skip
    return _math_backward(grad, q, k, v, out, lse, block, scale)


def _math_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad, qf, kf, vf = grad.float(), q.float(), k.float(), v.float()
    p = _probabilities(_scores(q, k, block, scale), lse)
    delta = (grad * out.float()).sum(-1, keepdim=True)
    ds = p * (torch.matmul(grad, vf.transpose(-1, -2)) - delta)
    return (
        torch.matmul(ds, kf) * scale,
        torch.matmul(ds.transpose(-1, -2), qf) * scale,
        torch.matmul(p.transpose(-1, -2), grad),
    )


_AGREE: dict[tuple[str, torch.dtype, int], bool] = {}
"""Whether torch's CUDA flash kernel computed a block as the math does, by (device, dtype, head width): checked
once each (the kernel's limits depend on the head width and the chip: its backward refuses some widths on some)."""


def cuda_kernels_agree(device: torch.device, dtype: torch.dtype, head_width: int = 64) -> bool:
    """The CUDA kernels against the math on a small block of this head width, forward and backward, causal and
    not, once per (device, dtype, width); where they disagree or fail, the math computes the blocks and a warning
    says why."""
    key = (str(device), dtype, head_width)
    if key not in _AGREE:
        try:
            reason = _disagreement(device, dtype, head_width)
        except Exception as error:  # noqa: BLE001 - any failure of the kernel path means: use the math
            reason = f"{type(error).__name__}: {error}"
        _AGREE[key] = reason is None
        if reason is not None:
            warnings.warn(
                f"Context parallelism on {device}: the ring's blocks compute in fp32 math, not with torch's flash"
                f" kernel in {dtype} ({reason}). Slower and with more memory; the results are the same.",
                stacklevel=2,
            )
    return _AGREE[key]


def _disagreement(device: torch.device, dtype: torch.dtype, head_width: int) -> str | None:
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (
        torch.randn(1, 2, 128, head_width, generator=generator).to(device, dtype) for _ in range(4)
    )
    scale = head_width**-0.5
    for causal in (False, True):
        block = Block(0, 0, causal)
        out, lse = flash_block(q, k, v, causal, scale)
        exact_out, exact_lse = _math_attend(q, k, v, block, scale)
        found = flash_block_backward(grad, q, k, v, out, lse, causal, scale)
        expected = _math_backward(grad, q, k, v, exact_out.to(dtype), exact_lse, block, scale)
        for name, got, want in (("output", out, exact_out), ("log-sum-exp", lse, exact_lse),
                                *zip(("dq", "dk", "dv"), found, expected, strict=True)):  # fmt: skip
            error = float((got.float() - want.float()).abs().max())
            # within bf16 rounding of the math; a wrong kernel call is off by O(1)
            if not error <= 0.03 * float(want.float().abs().max()) + 0.02:
                return f"{name} of a {'causal' if causal else 'full'} block differs by {error:.3g}"
    return None


def _merge(total: Partial, part: Partial) -> Partial:
    """Two partial softmax-weighted sums over disjoint keys, combined by their log-sum-exp."""
    (out, lse), (block_out, block_lse) = total, part
    top = torch.maximum(lse, block_lse)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    a, b = torch.exp(lse - top), torch.exp(block_lse - top)
    weight = a + b
    merged = (out * a.unsqueeze(-1) + block_out * b.unsqueeze(-1)) / torch.where(
        weight > 0, weight, torch.ones_like(weight)
    ).unsqueeze(-1)
    return merged, top + torch.log(weight)


class RingAttention(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` over the whole sequence, from this rank's chunks of q, k and v."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pairs: ChunkPairs,
        scale: float,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the fp32 math must stay fp32, as in backward
            return RingAttention._forward(ctx, q, k, v, pairs, scale, group)

    @staticmethod
    def _forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pairs: ChunkPairs,
        scale: float,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        groups, chunk = q.shape[1] // k.shape[1], pairs.chunk_size
        b, h, t, d = q.shape
        parts = [
            (
                torch.zeros((b, h, chunk, d), device=q.device),
                torch.full((b, h, chunk), float("-inf"), device=q.device),
            )
            for _ in range(t // chunk)
        ]
        visiting = (k, v)
        for hop in range(size):
            pending = _Exchange(visiting, group) if hop < size - 1 else None
            kx, vx = _expand(visiting[0], groups), _expand(visiting[1], groups)
            for block in pairs.blocks((rank - hop) % size, q.dtype, q.device):
                qs, ks = (
                    slice(block.q_index * chunk, (block.q_index + 1) * chunk),
                    slice(block.k_index * chunk, (block.k_index + 1) * chunk),
                )
                part = _attend(q[:, :, qs], kx[:, :, ks], vx[:, :, ks], block, scale)
                parts[block.q_index] = _merge(parts[block.q_index], part)
            if pending is not None:
                visiting = pending.wait()
        # Laid out (B, T, H, D) as flash kernels return it: the model's ``transpose(1, 2).reshape(B, T, -1)``
        # is then a view, and the output projection saves this storage rather than a copy of it.
        result = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
        result.copy_(torch.cat([out for out, _ in parts], dim=2))
        lse = torch.cat([lse for _, lse in parts], dim=2)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.pairs, ctx.scale, ctx.group = pairs, scale, group
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        with torch.autocast(grad_out.device.type, enabled=False):
            return RingAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        pairs, scale, group = ctx.pairs, ctx.scale, ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        groups, chunk = q.shape[1] // k.shape[1], pairs.chunk_size
        grad_out = grad_out.to(q.dtype).contiguous()
        dq = torch.zeros(q.shape, device=q.device)
        visiting = (k, v)
        incoming: _Exchange | None = None  # the visiting chunk's gradient so far, from the previous rank
        for hop in range(size):
            pending = _Exchange(visiting, group) if hop < size - 1 else None
            kx, vx = _expand(visiting[0], groups), _expand(visiting[1], groups)
            dk, dv = torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)
            for block in pairs.blocks((rank - hop) % size, q.dtype, q.device):
                qs, ks = (
                    slice(block.q_index * chunk, (block.q_index + 1) * chunk),
                    slice(block.k_index * chunk, (block.k_index + 1) * chunk),
                )
                dq_part, dk_part, dv_part = _attend_backward(
                    grad_out[:, :, qs],
                    q[:, :, qs],
                    kx[:, :, ks],
                    vx[:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs],
                    block,
                    scale,
                )
                dq[:, :, qs] += dq_part.float()
                dk[:, :, ks] += _fold(dk_part.float(), groups)
                dv[:, :, ks] += _fold(dv_part.float(), groups)
            if incoming is not None:  # received while this hop computed: added only now
                before_k, before_v = incoming.wait()
                dk, dv = dk + before_k, dv + before_v
            incoming = _Exchange((dk, dv), group)  # the chunk's gradient follows it (home after `size` hops)
            if pending is not None:
                visiting = pending.wait()
        assert incoming is not None
        dk, dv = incoming.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pairs: ChunkPairs,
    scale: float,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """This rank's attention output ``(B, H, T / C, D)``; ``k``/``v`` may have fewer heads (grouped queries)."""
    return RingAttention.apply(q, k, v, pairs, scale, group)
