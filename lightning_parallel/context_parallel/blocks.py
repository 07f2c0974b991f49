"""Which (query chunk, key chunk) pairs a hop of the ring computes, and how each is masked.

With the load-balanced split each rank holds two chunks of the sequence (``split.py``), so one hop
meets 2 x 2 chunk pairs. Under causal attention a pair whose keys all come after its queries is
skipped, a pair whose keys all come before is computed unmasked, and the pair of a chunk with
itself is causal within itself: for any two ranks exactly half of the key chunks are needed, so
every rank computes the same number of blocks (the point of the split). A mask the model computed
for the whole sequence is cut to each pair's rows and columns and handed to the block as an
additive bias in the query's dtype (what the fused kernel takes); rows it masks entirely are
reported, because the kernel gives them a log-sum-exp of 0 rather than minus infinity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_parallel.context_parallel.split import SequenceSplit


@dataclass(frozen=True)
class Block:
    """One chunk pair of a hop: this rank's query chunk ``q_index``, the visiting rank's key chunk ``k_index``."""

    q_index: int
    k_index: int
    causal: bool
    """The chunk with itself: causal within it (folded into ``bias`` when the model passed a mask)."""
    bias: torch.Tensor | None = None
    """Additive mask ``(..., size, size)`` in the query's dtype; None: nothing masked."""
    has_key: torch.Tensor | None = None
    """Rows that attend to at least one key of the chunk (None: every row)."""


def _cut(mask: torch.Tensor, rows: slice, columns: slice, length: int) -> torch.Tensor:
    if mask.shape[-2] == length:
        mask = mask[..., rows, :]
    if mask.shape[-1] == length:
        mask = mask[..., columns]
    return mask


@dataclass
class ChunkPairs:
    """The blocks between this rank's queries and each rank's keys, for one attention call."""

    split: SequenceSplit
    length: int
    is_causal: bool
    attn_mask: torch.Tensor | None
    _made: dict[tuple[int, torch.dtype], list[Block]] = field(default_factory=dict, repr=False)
    """Blocks by source: forward and backward of one call cut the mask (and sync on it) once."""

    @property
    def chunk_size(self) -> int:
        return self.length // self.split.num_chunks

    def blocks(self, source: int, dtype: torch.dtype, device: torch.device) -> list[Block]:
        key = (source, dtype)
        if key not in self._made:
            self._made[key] = self._blocks(source, dtype, device)
        return self._made[key]

    def _blocks(self, source: int, dtype: torch.dtype, device: torch.device) -> list[Block]:
        size = self.chunk_size
        mine, theirs = self.split.chunk_ids(self.split.rank), self.split.chunk_ids(source)
        blocks = []
        for i, q_chunk in enumerate(mine):
            for j, k_chunk in enumerate(theirs):
                if self.is_causal and k_chunk > q_chunk:
                    continue
                diagonal = self.is_causal and k_chunk == q_chunk
                if self.attn_mask is None:
                    blocks.append(Block(i, j, diagonal))
                    continue
                rows = slice(q_chunk * size, (q_chunk + 1) * size)
                columns = slice(k_chunk * size, (k_chunk + 1) * size)
                block = self._masked(
                    i,
                    j,
                    _cut(self.attn_mask, rows, columns, self.length),
                    diagonal=diagonal,
                    dtype=dtype,
                    device=device,
                )
                if block is not None:
                    blocks.append(block)
        return blocks

    def _masked(
        self, i: int, j: int, mask: torch.Tensor, *, diagonal: bool, dtype: torch.dtype, device: torch.device
    ) -> Block | None:
        size = self.chunk_size
        if mask.dtype == torch.bool:
            if diagonal:
                mask = mask & torch.ones(size, size, dtype=torch.bool, device=device).tril()
            if not bool(mask.any()):
                return None
            bias = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, float("-inf"))
            return Block(i, j, False, bias, mask.any(-1))
        bias = mask.to(dtype)
        if diagonal:
            bias = bias + torch.full((size, size), float("-inf"), dtype=dtype, device=device).triu(1)
        return Block(i, j, False, bias, torch.isfinite(bias).any(-1))
