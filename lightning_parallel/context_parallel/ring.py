"""Ring attention: each rank's queries meet every rank's keys and values as they rotate around the ring.

With ``C`` ranks, the keys and values of this rank's tokens travel ``C - 1`` hops (one chunk per
hop, sent while the previous one is being used); at each hop the local queries attend to the
visiting chunk, and the partial results are merged by their log-sum-exp (the online softmax of
flash attention, across ranks). Nothing of size ``T x T`` (or of the whole sequence) is ever held:
the saved tensors are this rank's queries, keys, values, output and log-sum-exp.

Backward rotates the keys and values again, with their gradients travelling beside them: each
rank adds what its queries contribute to the visiting chunk's gradient and passes it on; after
``C`` hops every chunk's gradient is back with its owner. Attention is computed in fp32 whatever
the input dtype (as flash kernels accumulate), and cast back.

Which pairs may attend (causal positions, the model's own mask) comes from a
:class:`~lightning_parallel.context_parallel.attention.KeyMask`: a hop whose pairs are all masked
is skipped, so the load-balanced split gives every rank the same work.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from lightning_parallel.context_parallel.traffic import TRAFFIC


class HopMask(Protocol):
    """What ring attention asks of the mask: the additive bias between this rank's queries and ``source``'s keys."""

    skipped: object

    def bias(self, source: int, device: torch.device) -> torch.Tensor | None | object: ...


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


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``groups`` consecutive query heads."""
    return kv.float() if groups == 1 else kv.float().repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_expand`: summed over the query heads a key/value head served."""
    if groups == 1:
        return grad
    b, h, t, d = grad.shape
    return grad.view(b, h // groups, groups, t, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, bias: Any) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return scores if bias is None else scores + bias


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    p = torch.exp(scores - lse.unsqueeze(-1))
    return torch.where(torch.isfinite(lse).unsqueeze(-1), p, torch.zeros_like(p))  # rows with no key: 0


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax-weighted sums over disjoint keys, combined by their log-sum-exp."""
    top = torch.maximum(lse, block_lse)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    a, b = torch.exp(lse - top), torch.exp(block_lse - top)
    total = a + b
    merged = (out * a.unsqueeze(-1) + block_out * b.unsqueeze(-1)) / torch.where(
        total > 0, total, torch.ones_like(total)
    ).unsqueeze(-1)
    return merged, top + torch.log(total)


class RingAttention(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` over the whole sequence, from this rank's chunk of q, k and v."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: HopMask,
        scale: float,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        qf = q.float()
        out = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        visiting = (k, v)
        for hop in range(size):
            pending = _Exchange(visiting, group) if hop < size - 1 else None
            bias = mask.bias((rank - hop) % size, q.device)
            if bias is not mask.skipped:
                kf, vf = _expand(visiting[0], groups), _expand(visiting[1], groups)
                scores = _scores(qf, kf, scale, bias)
                block_lse = torch.logsumexp(scores, dim=-1)
                block_out = torch.matmul(_probabilities(scores, block_lse), vf)
                out, lse = _merge(out, lse, block_out, block_lse)
            if pending is not None:
                visiting = pending.wait()
        # Laid out (B, T, H, D) as flash kernels return it: the model's ``transpose(1, 2).reshape(B, T, -1)``
        # is then a view, and the output projection saves this storage rather than a copy of it.
        b, h, t, d = out.shape
        result = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)
        result.copy_(out)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.mask, ctx.scale, ctx.group = mask, scale, group
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale, group = ctx.mask, ctx.scale, ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        groups = q.shape[1] // k.shape[1]
        qf, grad_out = q.float(), grad_out.float()
        delta = (grad_out * out.float()).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        visiting = (k, v)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        for hop in range(size):
            pending = _Exchange(visiting, group) if hop < size - 1 else None
            bias = mask.bias((rank - hop) % size, q.device)
            if bias is not mask.skipped:
                kf, vf = _expand(visiting[0], groups), _expand(visiting[1], groups)
                p = _probabilities(_scores(qf, kf, scale, bias), lse)
                dv = dv + _fold(torch.matmul(p.transpose(-1, -2), grad_out), groups)
                ds = p * (torch.matmul(grad_out, vf.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(ds, kf) * scale
                dk = dk + _fold(torch.matmul(ds.transpose(-1, -2), qf) * scale, groups)
            gradients = _Exchange((dk, dv), group)  # the chunk's gradient follows it (home after `size` hops)
            if pending is not None:
                visiting = pending.wait()
            dk, dv = gradients.wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: HopMask, scale: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """This rank's attention output ``(B, H, T / C, D)``; ``k``/``v`` may have fewer heads (grouped queries)."""
    return RingAttention.apply(q, k, v, mask, scale, group)
