"""Gradient reduction as explicit bucketed all-reduces, for layouts DDP-style hooks cannot serve.

Used once per optimizer step (after the last accumulation batch) when

- pipeline schedules run backward per micro-batch (and split input and weight gradients), and
- experts are sharded: expert weights are reduced over the expert-replica ranks only
  (``dp_replicate``), every other weight over all data-parallel ranks.

Each :class:`GradientGroup` is "these parameters, summed over this group, divided by this
number"; weights tied across pipeline stages are a group that sums (divisor 1). A
:class:`GradientScale` divides gradients without communicating (expert gradients before ZeRO
averages them). :class:`GradientSync` runs a layout's reductions in order; which reductions a
layout needs is decided in one place, ``parallelize/gradients.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class GradientGroup:
    parameters: list[nn.Parameter]
    group: dist.ProcessGroup
    divisor: int = 1  # the sum over the group is divided by this
    # A ``lightning_parallel.comm.BucketCompressor`` for a plain mean (divisor = group size).
    compressor: Any = None
    label: str = ""  # what the reduction is for, in ``describe()``

    def reduce(self) -> None:
        if dist.get_world_size(self.group) > 1 or self.divisor != 1:
            all_reduce_gradients(self.parameters, self.group, self.divisor, self.compressor)

    @property
    def is_mean(self) -> bool:
        """A plain average over more than one rank: the only reduction a compressor may approximate."""
        return self.divisor == dist.get_world_size(self.group) > 1

    def describe(self) -> str:
        size = dist.get_world_size(self.group)
        how = "mean" if self.divisor == size else "sum" if self.divisor == 1 else f"sum / {self.divisor}"
        compressed = f", compressed ({self.compressor.compression!r})" if self.compressor is not None else ""
        return f"{self.label or 'gradients'}: {how} over {size} ranks ({len(self.parameters)} tensors){compressed}"


@dataclass
class GradientScale:
    """Divide gradients by ``divisor``, without communicating (the other ranks' share comes later)."""

    parameters: list[nn.Parameter]
    divisor: int
    label: str = ""

    def reduce(self) -> None:
        for param in self.parameters:
            if param.grad is not None:
                param.grad.div_(self.divisor)

    def describe(self) -> str:
        return f"{self.label or 'gradients'}: divided by {self.divisor} ({len(self.parameters)} tensors)"


@dataclass
class GradientSync:
    """The explicit reductions of one layout, applied in order (identical order on every rank of a group)."""

    groups: list[GradientGroup | GradientScale]

    def __call__(self) -> None:
        for group in self.groups:
            group.reduce()

    def describe(self) -> list[str]:
        return [group.describe() for group in self.groups]


def all_reduce_gradients(
    params: Sequence[nn.Parameter], group: dist.ProcessGroup, divisor: int = 1, compressor: Any = None
) -> None:
    """Bucketed all-reduce of the gradients' local shards, divided by ``divisor``; missing gradients count as zeros.

    ``compressor`` (for a mean: ``divisor`` equal to the group size) averages each bucket in a
    compressed form instead.
    """
    grads: list[torch.Tensor] = []
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
            # The same weight's gradient may arrive in another layout on another rank (a tied
            # embedding's is replicated, the head's sharded): bring both to the weight's layout.
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        grad = param.grad
        grads.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for grad in grads:
        lists = buckets.setdefault((grad.device, grad.dtype), [[]])
        if sum(g.numel() * g.element_size() for g in lists[-1]) > BUCKET_BYTES:
            lists.append([])
        lists[-1].append(grad)
    ordered = [bucket for lists in buckets.values() for bucket in lists]
    mean = divisor == dist.get_world_size(group)
    for index, bucket in enumerate(ordered):
        flat = torch._utils._flatten_dense_tensors(bucket)
        if compressor is not None and mean:
            compressor.all_reduce_mean(
                flat, [g.shape for g in bucket], group, index, index == len(ordered) - 1
            )
        else:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            if divisor != 1:
                flat.div_(divisor)
        for grad, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(reduced)
