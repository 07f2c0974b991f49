"""All-to-all (DeepSpeed Ulysses) attention: for attention, trade the sequence split for a head split.

Entering attention, one all-to-all turns each rank's ``(B, H, T / C, D)`` queries, keys and values
into ``(B, H / C, T, D)``: every token, for ``H / C`` heads. Attention then runs as in one process
(torch's own ``scaled_dot_product_attention``, with the model's mask and flags unchanged, since the
sequence is whole and in order), and a second all-to-all gives each rank its tokens back, for
every head. Cheaper than the ring when ``C`` divides the heads (each rank sends ``3 / C`` of its
q, k, v and ``1 / C`` of its output instead of ``C - 1`` key/value chunks), but it needs them to.

Tokens arrive in rank order (with the load-balanced split, rank ``r``'s head and tail chunks
side by side); they are put in sequence order before attention and back after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.context_parallel.split import SequenceSplit
from lightning_parallel.context_parallel.traffic import TRAFFIC
from lightning_parallel.experts.dispatch import all_to_all


def _exchange(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row ``j`` of ``rows`` (``(C, ...)``) to rank ``j``; row ``s`` of the result came from rank ``s``."""
    size = rows.shape[0]
    # Counted for the backward too (the reverse all-to-all of the gradient, same size) when one will run.
    directions = 2 if rows.requires_grad and torch.is_grad_enabled() else 1
    TRAFFIC.add("all_to_all", rows[0].numel() * rows.element_size() * (size - 1) * directions)
    ones = [1] * size
    return all_to_all(rows.reshape(size, -1), ones, ones, group).view(rows.shape)


def to_heads(
    x: torch.Tensor, split: SequenceSplit, group: dist.ProcessGroup, order: torch.Tensor | None = None
) -> torch.Tensor:
    """``(B, H, T / C, D)`` of this rank's tokens -> ``(B, H / C, T, D)`` of every token, in sequence order.

    ``order``: ``split.natural_order`` of the whole sequence, when the caller shares one among q, k, v
    (each ``index_select`` keeps its index for backward: one tensor is kept once)."""
    c = split.degree
    b, h, t, d = x.shape
    rows = x.reshape(b, c, h // c, t, d).transpose(0, 1)  # (C, B, H/C, T/C, D): head group j -> rank j
    received = _exchange(rows.contiguous(), group)  # (C, B, H/C, T/C, D): rank s's tokens
    whole = received.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * t, d)  # rank order
    return whole.index_select(2, split.natural_order(c * t, x.device) if order is None else order)


def to_sequence(x: torch.Tensor, split: SequenceSplit, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`to_heads`: ``(B, H / C, T, D)`` -> ``(B, H, T / C, D)`` of this rank's tokens."""
    c = split.degree
    b, hc, length, d = x.shape
    ranked = x.index_select(2, split.gathered_order(length, x.device))
    # (C, B, H/C, T/C, D): rank s's tokens
    rows = ranked.view(b, hc, c, length // c, d).permute(2, 0, 1, 3, 4)
    received = _exchange(rows.contiguous(), group)  # (C, B, H/C, T/C, D): head group j, my tokens
    # Laid out (B, T/C, H, D) as flash kernels return it (see ``ring.py``), seen as (B, H, T/C, D).
    return received.permute(1, 3, 0, 2, 4).reshape(b, length // c, c * hc, d).transpose(1, 2)


def heads_check(heads: int, degree: int) -> None:
    if heads % degree:
        raise ValueError(
            f"`context_parallel_mode='ulysses'` with `context_parallel={degree}` needs the attention heads each"
            f" rank runs to be divisible by {degree}: an attention has {heads} heads here (after tensor"
            " parallelism's split). Use `context_parallel_mode='ring'` (no condition on heads), or a"
            f" `context_parallel` that divides {heads}."
        )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    split: SequenceSplit,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """This rank's tokens of ``scaled_dot_product_attention`` over the whole sequence, heads split over the group."""
    c, heads, kv_heads = split.degree, q.shape[1], k.shape[1]
    heads_check(heads, c)
    if kv_heads != heads and kv_heads % c:  # too few key/value heads to split: give every query head its own
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        enable_gqa = False
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[1] == heads:
        rank = dist.get_rank(group)
        attn_mask = attn_mask[:, rank * heads // c : (rank + 1) * heads // c]
    order = split.natural_order(q.shape[2] * c, q.device)
    out = F.scaled_dot_product_attention(
        to_heads(q, split, group, order),
        to_heads(k, split, group, order),
        to_heads(v, split, group, order),
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return to_sequence(out, split, group)
