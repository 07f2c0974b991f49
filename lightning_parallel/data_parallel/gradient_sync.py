"""Gradient reduction as explicit bucketed all-reduces, for layouts DDP-style hooks cannot serve.

Used once per optimizer step (the last accumulation batch) when

- pipeline schedules run backward per micro-batch (and split input and weight gradients), and
- experts are sharded: expert weights are reduced over the expert-replica ranks only
  (``dp_replicate``), every other weight over all data-parallel ranks.

Each :class:`GradientGroup` is "these parameters, summed over this group, divided by this
number"; weights tied across pipeline stages are a group that sums (divisor 1). A
:class:`GradientScale` divides gradients without communicating (expert gradients before ZeRO
averages them). :class:`GradientSync` runs a layout's reductions; which reductions a layout needs
is decided in one place, ``parallelize/reductions.py``.

A group marked ``overlap`` is reduced while the last backward of the step runs
(``data_parallel/buckets.py``): between :meth:`GradientSync.begin_final` and
:meth:`GradientSync.end_final` (one backward call: the step's, or a pipeline stage's last
micro-batch) each parameter whose gradient is accumulated for the last time has its bucket launched
as soon as the bucket is complete. Calling the sync then only waits and writes the results, before
the other reductions run in their order (all of them are linear, so the order only matters in that
the overlapped ones read the gradients as backward left them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.compat import flatten_dense_tensors, unflatten_dense_tensors
from lightning_parallel.data_parallel.buckets import BUCKET_BYTES, BucketedReduction, local_gradient


@dataclass
class GradientGroup:
    parameters: list[nn.Parameter]
    group: dist.ProcessGroup
    divisor: int = 1  # the sum over the group is divided by this
    # A ``lightning_parallel.comm.BucketCompressor`` for a plain mean (divisor = group size).
    compressor: Any = None
    label: str = ""  # what the reduction is for, in ``describe()``
    overlap: bool = False  # reduced bucket by bucket during the last backward (``GradientSync``)

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
        during = ", during the last backward" if self.overlap else ""
        return f"{self.label or 'gradients'}: {how} over {size} ranks ({len(self.parameters)} tensors){compressed}{during}"


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
    """The explicit reductions of one layout (identical order on every rank of a group).

    ``final_calls``: for each parameter (by id), how many final backward calls contribute to its
    gradient (default 1; a weight two pipeline stages of this rank both use gets 2).
    """

    groups: list[GradientGroup | GradientScale]
    final_calls: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        overlapped = [g for g in self.groups if isinstance(g, GradientGroup) and g.overlap]
        if any(g.compressor is not None for g in overlapped):
            raise ValueError("A compressed gradient group is reduced after backward, not overlapped.")
        self.overlapped = [BucketedReduction(g.parameters, g.group, g.divisor) for g in overlapped]
        self.rest = [g for g in self.groups if not (isinstance(g, GradientGroup) and g.overlap)]
        self._reductions_of: dict[int, list[BucketedReduction]] = {}
        self._params: dict[int, nn.Parameter] = {}
        for reduction in self.overlapped:
            for param in reduction.parameters:
                self._reductions_of.setdefault(id(param), []).append(reduction)
                self._params[id(param)] = param
        self.hooks = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self._params.values()]
        self._remaining: dict[int, int] = {}  # this step's final calls still to come, per parameter
        self._open: set[int] | None = None  # the parameters the running final call covers
        self._seen: set[int] = set()
        self.overlap_counts: tuple[int, int] = (0, 0)
        """The last reduction's buckets launched during backward, and all its buckets (the overlap, counted)."""

    def begin_final(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """A backward call follows that is the last to add to ``params``' gradients (None: every parameter)."""
        ids = set(self._params) if params is None else {id(p) for p in params} & set(self._params)
        self._open, self._seen = ids, set()

    def end_final(self) -> None:
        """That call returned: its parameters no gradient hook reported (no gradient, or one assigned
        outside autograd's accumulation, as the zero-bubble schedules' weight pass does) are final too."""
        if self._open is None:
            return
        for pid in self._open - self._seen:  # any order: buckets launch in their own order
            self._final_contribution(pid)
        self._open = None

    def _accumulated(self, param: nn.Parameter) -> None:
        pid = id(param)
        if self._open is not None and pid in self._open and pid not in self._seen:
            self._seen.add(pid)
            self._final_contribution(pid)

    def _final_contribution(self, pid: int) -> None:
        remaining = self._remaining.get(pid, self.final_calls.get(pid, 1)) - 1
        self._remaining[pid] = remaining
        if remaining == 0:
            for reduction in self._reductions_of[pid]:
                reduction.final(self._params[pid])

    def __call__(self) -> None:
        launched = sum(r.launched for r in self.overlapped)
        self.end_final()
        self.overlap_counts = (launched, sum(len(r.buckets) for r in self.overlapped))
        for reduction in self.overlapped:
            reduction.finish()
        self._remaining.clear()
        for group in self.rest:
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
    grads = [local_gradient(param) for param in params]
    buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for grad in grads:
        lists = buckets.setdefault((grad.device, grad.dtype), [[]])
        if sum(g.numel() * g.element_size() for g in lists[-1]) > BUCKET_BYTES:
            lists.append([])
        lists[-1].append(grad)
    ordered = [bucket for lists in buckets.values() for bucket in lists]
    mean = divisor == dist.get_world_size(group)
    for index, bucket in enumerate(ordered):
        alone = len(bucket) == 1 and bucket[0].is_contiguous()  # reduced in place: no copy in, none out
        flat = bucket[0].view(-1) if alone else flatten_dense_tensors(bucket)
        if compressor is not None and mean:
            compressor.all_reduce_mean(
                flat, [g.shape for g in bucket], group, index, last=index == len(ordered) - 1
            )
        else:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            if divisor != 1:
                flat.div_(divisor)
        if alone:
            continue
        for grad, reduced in zip(bucket, unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(reduced)
