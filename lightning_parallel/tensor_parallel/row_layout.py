"""Weights a tensor-parallel rank stores in another row order than the user's, or with rows on several ranks.

Two layouts of attention projections fit no DTensor placement of the user's tensor:

- a fused ``q|k|v`` projection of unequal widths (Phi-3's ``qkv_proj``: ``heads`` query rows, then
  fewer key and value rows, grouped-query attention): a rank needs its slice of each of the three
  blocks, ``[q_r; k_r; v_r]``, and torch's ``_StridedShard`` cuts equal blocks only;
- fewer key/value heads than tensor-parallel ranks (multi-query attention, Gemma's one k/v head,
  GPT-BigCode's fused ``[q; k; v]``): the ranks whose query heads share a k/v head each need that
  head's rows, which are then on several ranks.

Such a weight is stored as :class:`RowLayout` says: the rows of the user's tensor in the order
``index`` gives, rank ``r`` holding the ``r``-th block of stored rows (``Shard`` of the stored tensor),
so every sharding, matmul and optimizer step is an ordinary one. The layout is marked on the
parameter (``ROW_LAYOUT``) and undone wherever the user's tensor is meant: checkpoints hold the
user's rows (``checkpoint/layouts.py``), the verification compares the user's gradients, the
global norm counts a row held on several ranks once (``precision/grad_norm.py``), and each step
the copies' gradients (each rank's share of a row held several times) are summed over the ranks
(:class:`RowCopies`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

ROW_LAYOUT = "_lp_row_layout"


@dataclass(frozen=True)
class RowLayout:
    """Stored row ``i`` (along ``dim``) holds the user's row ``index[i]``; ``ranks`` ranks hold equal blocks."""

    index: tuple[int, ...]
    rows: int
    ranks: int
    dim: int = 0
    label: str = ""

    @classmethod
    def of_blocks(cls, blocks: Sequence[tuple[int, int]], ranks: int, label: str = "") -> RowLayout:
        """The user's rows as consecutive ``blocks`` of ``(rows, pieces)``: rank ``r`` stores piece
        ``r * pieces // ranks`` of each block (several pieces when ``pieces > ranks``; a piece is then on
        ``ranks / pieces`` ranks). ``[(q, heads), (k, kv_heads), (v, kv_heads)]`` is Phi-3's ``qkv_proj``."""
        index: list[int] = []
        for rank in range(ranks):
            start = 0
            for rows, pieces in blocks:
                if rows % pieces or (pieces % ranks and ranks % pieces):
                    raise ValueError(f"{rows} rows in {pieces} pieces cannot be split over {ranks} ranks")
                size = rows // pieces
                first, count = rank * pieces // ranks, max(pieces // ranks, 1)
                index += range(start + first * size, start + (first + count) * size)
                start += rows
        return cls(tuple(index), sum(rows for rows, _ in blocks), ranks, label=label)

    @classmethod
    def of_groups(cls, rows: int, groups: int, parts: int, ranks: int, label: str = "") -> RowLayout:
        """The user's rows as ``groups`` equal groups of ``parts`` equal parts (CodeGen's ``qkv_proj``: 4
        groups of its q, v and k), read by code that cuts any width into ``groups`` groups, a constant of the model:
        each rank stores, in each of its groups, the rows that code then reads as the rank's heads. Part ``s``
        flattened over the groups holds the heads in order; rank ``r`` holds that order's ``r``-th block,
        cut into its ``groups`` groups likewise."""
        part = rows // (groups * parts)  # rows of one part of one group
        if rows % (groups * parts) or part % ranks:
            raise ValueError(
                f"{rows} rows in {groups} groups of {parts} parts cannot be split over {ranks} ranks"
            )
        local = part // ranks  # rows of one part of one group on one rank
        index = [
            (flat // part) * parts * part + s * part + flat % part
            for rank in range(ranks)
            for group in range(groups)
            for s in range(parts)
            for flat in range((rank * groups + group) * local, (rank * groups + group + 1) * local)
        ]
        return cls(tuple(index), rows, ranks, label=label)

    def along(self, dim: int) -> RowLayout:
        return dataclasses.replace(self, dim=dim)

    @property
    def per_rank(self) -> int:
        return len(self.index) // self.ranks

    @property
    def duplicated(self) -> bool:
        return len(self.index) > self.rows

    @cached_property
    def copies(self) -> torch.Tensor:
        """Per stored row, how many stored rows hold the same user row."""
        index = torch.tensor(self.index)
        return torch.bincount(index, minlength=self.rows)[index]

    @cached_property
    def _first(self) -> torch.Tensor:
        """Per user row, the first stored row that holds it."""
        first = {}
        for position, row in enumerate(self.index):
            first.setdefault(row, position)
        return torch.tensor([first[row] for row in range(self.rows)])

    def stored(self, user: torch.Tensor) -> torch.Tensor:
        """The stored tensor of the user's ``user``."""
        return user.index_select(self.dim, torch.tensor(self.index, device=user.device))

    def user(self, stored: torch.Tensor) -> torch.Tensor:
        """The user's tensor of a stored one whose copies agree (weights, optimizer states)."""
        return stored.index_select(self.dim, self._first.to(stored.device))

    def summed(self, stored: torch.Tensor) -> torch.Tensor:
        """The user's tensor of a stored gradient: each row the sum of its copies' shares."""
        shape = list(stored.shape)
        shape[self.dim] = self.rows
        index = torch.tensor(self.index, device=stored.device)
        return stored.new_zeros(shape).index_add_(self.dim, index, stored)

    def local_rows(self, rank: int) -> slice:
        return slice(rank * self.per_rank, (rank + 1) * self.per_rank)

    def measured(self, local: torch.Tensor, p: float, rank: int) -> torch.Tensor:
        """``local`` (this rank's stored rows) weighted so that its ``p``-th power sums count each user row once."""
        if not self.duplicated or p == float("inf"):
            return local
        copies = self.copies[self.local_rows(rank)].to(local.device, local.dtype)
        shape = [1] * local.dim()
        shape[self.dim] = -1
        return local * copies.pow(-1.0 / p).view(shape)


def row_layout(param: torch.Tensor) -> RowLayout | None:
    return getattr(param, ROW_LAYOUT, None)


@dataclass
class RowCopies:
    """After backward: the gradient of each row stored on several ranks becomes the sum of its copies' shares.

    Each rank computes a shared k/v row's gradient from its own query heads only; the row's true gradient
    is the sum over the ranks holding it, which every copy must receive so that the copies stay equal.
    One all-gather over ``tp`` of the duplicated rows per parameter and optimizer step.
    """

    parameters: list[nn.Parameter]
    group: dist.ProcessGroup
    # per parameter: its shared local rows and every rank's user rows of them, on the gradient's device;
    # fixed by the layout, so made once (a host-to-device copy per step otherwise)
    _indices: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)

    def _rows(
        self, param: nn.Parameter, layout: RowLayout, device: torch.device
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if id(param) not in self._indices:
            rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
            shared = (layout.copies[layout.local_rows(rank)] > 1).nonzero().flatten().to(device)
            index = torch.tensor(layout.index, device=device)
            owners = [index[layout.local_rows(r)].index_select(0, shared) for r in range(size)]
            self._indices[id(param)] = (shared, owners)
        return self._indices[id(param)]

    def reduce(self) -> None:
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        for param in self.parameters:
            layout = row_layout(param)
            if layout is None or param.grad is None:
                continue
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            shared, owners = self._rows(param, layout, local.device)
            rows = local.index_select(layout.dim, shared).contiguous()
            gathered = [torch.empty_like(rows) for _ in range(size)]
            dist.all_gather(gathered, rows, group=self.group)
            shape = list(rows.shape)
            shape[layout.dim] = layout.rows
            total = rows.new_zeros(shape)
            for owner, part in zip(owners, gathered, strict=True):
                total.index_add_(layout.dim, owner, part)
            local.index_copy_(layout.dim, shared, total.index_select(layout.dim, owners[rank]))

    def describe(self) -> str:
        return f"rows held on several tensor-parallel ranks: their copies' gradients summed ({len(self.parameters)} tensors)"


REGISTRY = "_lp_row_layouts"  # on the module tensor parallelism was applied to: {parameter name: RowLayout}


def record_row_layouts(module: nn.Module) -> dict[str, RowLayout]:
    """Remember which parameters of ``module`` are stored in a row layout, by name (wrappers applied later,
    such as data parallelism's, replace the parameter objects and drop their marks)."""
    found = {name: layout for name, p in module.named_parameters() if (layout := row_layout(p)) is not None}
    setattr(module, REGISTRY, found)
    return found


def stamp_row_layouts(module: nn.Module) -> list[nn.Parameter]:
    """Mark the parameters ``module`` holds now with their recorded layouts; returns those with rows on several
    ranks (their copies' gradients must be summed: :class:`RowCopies`)."""
    duplicated = []
    for name, layout in getattr(module, REGISTRY, {}).items():
        try:
            param = module.get_parameter(name)
        except AttributeError:  # another pipeline stage holds it
            continue
        setattr(param, ROW_LAYOUT, layout)
        if layout.duplicated:
            duplicated.append(param)
    return duplicated
