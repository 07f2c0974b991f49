"""Which tokens of a sequence each context-parallel rank holds, and moving them in and out of the split.

Causal attention does more work for late queries than for early ones (query ``t`` attends to
``t + 1`` keys). Cut into ``C`` contiguous parts, the last rank would do ``2C - 1`` times the work
of the first. With ``load_balanced`` (the default, as Megatron and torchtitan do) the sequence is
cut into ``2C`` chunks and rank ``r`` holds chunk ``r`` and chunk ``2C - 1 - r``: a head and a tail,
so every rank does the same attention work.

The split is entered once, at the first block, and left once, after the last
(``context_parallel/hooks.py``). Its gradients are chosen so that the strategy's one rule for
replicated parameters (gradients averaged over every data-parallel rank, ``cp`` included) is
exact:

- leaving the split, a gather makes the whole sequence on every rank (after the last block outside
  training steps; in training steps only where the step needs it, per-token losses at least:
  ``local_tokens.py``), and what follows it is the same computation on every rank: its gradient is
  the same everywhere, so the backward of the gather takes this rank's tokens and multiplies them
  by ``C``: that is the reduce-scatter (sum) of ``C`` equal gradients, without its communication;
- entering the split is an ``index_select``: its backward puts this rank's gradient back at its
  positions, zeros elsewhere (no communication).

Every gradient before a gather (inside the stack, and the final norm's and head's where they run on
this rank's tokens) is then ``C`` times this rank's part; averaged over the ``C`` ranks it is the sum
of the parts, which is the one-process gradient. Gradients of what runs after a gather are equal on
every rank, and their average is themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.compat import tree_map_only
from lightning_parallel.context_parallel.traffic import TRAFFIC

SEQUENCE_DIM = 1


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's share of every sequence: ``degree`` ranks, this one ``rank``."""

    degree: int
    rank: int
    load_balanced: bool = True

    @property
    def num_chunks(self) -> int:
        return 2 * self.degree if self.load_balanced else self.degree

    def check(self, length: int) -> None:
        """A ``ValueError`` for a sequence this split cannot cut evenly."""
        if length % self.num_chunks:
            how = (
                f"{self.num_chunks} (2 x context_parallel: each rank holds a head and a tail chunk, so causal"
                " attention work is even)"
                if self.load_balanced
                else f"{self.num_chunks} (context_parallel)"
            )
            raise ValueError(
                f"`context_parallel={self.degree}` needs a sequence length divisible by {how}; this batch has"
                f" sequences of {length} tokens. Pad or crop the sequences to a multiple of {self.num_chunks}"
                " (the DataLoader's block size), or choose another `context_parallel`."
            )

    def chunk_ids(self, rank: int) -> tuple[int, ...]:
        if self.load_balanced:
            return (rank, 2 * self.degree - 1 - rank)
        return (rank,)

    def positions(
        self, length: int, device: torch.device | str = "cpu", rank: int | None = None
    ) -> torch.Tensor:
        """Global positions of ``rank``'s tokens (this rank's by default), in the order it holds them."""
        self.check(length)
        size = length // self.num_chunks
        ids = self.chunk_ids(self.rank if rank is None else rank)
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in ids])

    def gathered_order(self, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of the rank-ordered concatenation of every rank's tokens."""
        return torch.cat([self.positions(length, device, r) for r in range(self.degree)])

    def natural_order(self, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The permutation that puts the rank-ordered concatenation back in sequence order."""
        return torch.argsort(self.gathered_order(length, device))


def scatter(x: torch.Tensor, split: SequenceSplit, dim: int) -> torch.Tensor:
    """This rank's tokens of the whole sequence along ``dim`` (backward: gradients back at their positions)."""
    return x.index_select(dim, split.positions(x.shape[dim], x.device))


class _GatherSequence(torch.autograd.Function):
    """All ranks' tokens in sequence order; backward: this rank's tokens of the (equal) gradient, times C."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        split: SequenceSplit,
        group: dist.ProcessGroup,
        dim: int,
    ) -> torch.Tensor:
        ctx.split, ctx.dim = split, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(split.degree)]
        dist.all_gather(parts, x, group=group)
        TRAFFIC.add("all_gather", x.numel() * x.element_size() * (split.degree - 1))
        full = torch.cat(parts, dim=dim)
        return full.index_select(dim, split.natural_order(full.shape[dim], full.device))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        split: SequenceSplit = ctx.split
        mine = grad.index_select(ctx.dim, split.positions(grad.shape[ctx.dim], grad.device))
        return mine * split.degree, None, None, None


def gather(
    x: torch.Tensor, split: SequenceSplit, group: dist.ProcessGroup, dim: int = SEQUENCE_DIM
) -> torch.Tensor:
    """The whole sequence from every rank's tokens (see the module docstring for its gradient)."""
    return _GatherSequence.apply(x, split, group, dim)


def sequence_dim(tensor: torch.Tensor, length: int) -> int | None:
    """Where a tensor handed to a block carries the sequence (``None``: it carries none, or it is a mask).

    Batch-first tensors (hidden states, rotary tables ``(B, T, D)``, position ids ``(B, T)``) carry
    it in dim 1, per-token vectors (``cache_position``, ``(T,)``) and tables ``(T, D)`` in dim 0.
    Tensors with two dims of the sequence's length are attention masks: they stay whole, and the
    attention reads the rows and columns it needs (``context_parallel/attention.py``).
    """
    if sum(1 for size in tensor.shape if size == length) != 1:
        return None
    if tensor.dim() >= 2 and tensor.shape[1] == length:
        return 1
    if tensor.shape[0] == length:
        return 0
    return None


def scatter_side_inputs(value: Any, split: SequenceSplit, length: int) -> Any:
    """Every tensor of a block's other arguments (inside tuples, lists, dicts too) cut to this rank's tokens."""

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        dim = sequence_dim(tensor, length)
        return tensor if dim is None else scatter(tensor, split, dim)

    return tree_map_only(torch.Tensor, cut, value)
