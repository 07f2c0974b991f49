"""Rank functions of the attention tests (run by ``tests.experts.spawn.run_ranks``).

Every rank builds the same global q, k, v (and mask, cotangent), computes torch's
``scaled_dot_product_attention`` on the whole sequence itself, then its own tokens' attention over
the context group, gathered back whole. Gradients are averaged over the ranks, as the
data-parallel reduction averages them in training (``context_parallel/split.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.context_parallel import TRAFFIC, ContextState, SequenceSplit, attend, gather, scatter

RTOL, ATOL = 1e-5, 1e-6
SHAPES = {"batch": 2, "heads": 4, "length": 32, "dim": 8}


def _inputs(kv_heads: int, masked: bool | str) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    b, h, t, d = SHAPES["batch"], SHAPES["heads"], SHAPES["length"], SHAPES["dim"]
    q = torch.randn(b, h, t, d, generator=generator)
    k = torch.randn(b, kv_heads, t, d, generator=generator)
    v = torch.randn(b, kv_heads, t, d, generator=generator)
    cotangent = torch.randn(b, h, t, d, generator=generator)
    mask = (torch.rand(b, 1, t, t, generator=generator) > 0.3) | torch.eye(t, dtype=torch.bool)
    if (
        masked == "empty_row"
    ):  # a query that may attend to nothing (a padded position): output 0, finite gradients
        mask[:, :, 5] = False
    if masked == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    return q, k, v, cotangent, (mask if masked else None)


def _attention(
    mode: str, split: SequenceSplit, q, k, v, mask, causal: bool, local_only: bool
) -> torch.Tensor:
    group = dist.group.WORLD
    lq, lk, lv = (scatter(t, split, 2) for t in (q, k, v))
    if local_only:  # the negative control: attention over this rank's tokens alone
        local_mask = (
            None
            if mask is None
            else mask.index_select(-2, split.positions(q.shape[2])).index_select(
                -1, split.positions(q.shape[2])
            )
        )
        out = F.scaled_dot_product_attention(lq, lk, lv, attn_mask=local_mask, is_causal=causal,
                                             enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
    else:
        state = ContextState(split, group, mode)  # type: ignore[arg-type]
        out = attend(state, lq, lk, lv, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
        assert state.calls == 1
    return gather(out, split, group, dim=2)


def compare(rank: int, world_size: int, mode: str, kv_heads: int, causal: bool, masked: bool | str,
            load_balanced: bool, local_only: bool = False, fused: bool = True) -> dict[str, float]:  # fmt: skip
    """Largest absolute error of the output and of each gradient against one process; the bytes sent.

    ``fused=False``: the ring's blocks run the written-out math (what devices without the fused CPU
    kernel run) instead of torch's kernel.
    """
    from lightning_parallel.context_parallel import ring

    ring.fused = (lambda device: device.type == "cpu") if fused else (lambda device: False)
    q, k, v, cotangent, mask = _inputs(kv_heads, masked)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal,
                                              enable_gqa=kv_heads != q.shape[1])  # fmt: skip
    (expected * cotangent).sum().backward()
    want = [expected.detach()] + [t.grad for t in leaves]
    mine = [t.clone().requires_grad_(True) for t in (q, k, v)]
    TRAFFIC.reset()
    out = _attention(mode, SequenceSplit(world_size, rank, load_balanced), *mine, mask, causal, local_only)
    (out * cotangent).sum().backward()
    grads = [t.grad.clone() for t in mine]
    for grad in grads:
        dist.all_reduce(grad)
        grad.div_(world_size)
    got = [out.detach(), *grads]
    errors = {
        name: (a - b).abs().max().item()
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
    }
    close = all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(got, want, strict=True))
    close = close and all(bool(torch.isfinite(g).all()) for g in got)
    return {
        **errors,
        "close": float(close),
        **{f"{k}_bytes": float(n) for k, n in TRAFFIC.snapshot().items()},
    }


def compare_all(rank: int, world_size: int, settings: list[tuple]) -> list[dict[str, float]]:
    """:func:`compare` for each of ``settings`` in one launch (a launch costs seconds, a setting milliseconds)."""
    return [compare(rank, world_size, *setting) for setting in settings]
