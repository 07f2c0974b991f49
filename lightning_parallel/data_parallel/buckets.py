"""Persistent gradient buckets, each all-reduced as soon as its gradients are final: DDP's overlap, explicitly.

Layouts whose reductions DDP's reducer cannot express (pipeline schedules, sharded experts) used
to flatten every gradient into fresh buffers and all-reduce them after the last backward, so the
whole data-parallel reduction was exposed. Here each reduction keeps its buckets from step to step
(one flat buffer each, allocated once) and launches a bucket's asynchronous all-reduce from the
gradient hook that makes its last gradient final, while backward goes on through the blocks below;
:meth:`BucketedReduction.finish` waits, divides and copies the results back.

Buckets are launched strictly in their index order, as DDP's are: a bucket that is complete waits
for the ones before it. Every rank of the group therefore issues the same all-reduces in the same
order, even where one rank's gradient is final earlier than another's (an expert no token reached
on one rank) or never marked (those are launched by ``finish``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket: large enough to amortise a collective's latency


def local_gradient(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param.grad`` (zeros where backward produced none), in the weight's own layout.

    The same weight's gradient may arrive in another layout on another rank (a tied embedding's is
    replicated, the head's sharded): it is brought to the weight's placements first.
    """
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _local_shape(param: nn.Parameter) -> tuple[torch.Size, torch.dtype, torch.device]:
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.shape, local.dtype, local.device


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    numel: int
    dtype: torch.dtype
    device: torch.device
    waiting: int = 0  # gradients not final yet this step
    flat: torch.Tensor | None = None  # kept from step to step
    work: Any = None

    def launch(self, group: dist.ProcessGroup) -> None:
        if self.flat is None:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        offset = 0
        for param in self.params:
            grad = local_gradient(param)
            self.flat[offset : offset + grad.numel()].copy_(grad.reshape(-1))
            offset += grad.numel()
        if dist.get_world_size(group) > 1:
            self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def land(self, divisor: int) -> None:
        assert self.flat is not None
        if self.work is not None:
            self.work.wait()
            self.work = None
        if divisor != 1:
            self.flat.div_(divisor)
        offset = 0
        for param in self.params:
            grad = local_gradient(param)
            grad.copy_(self.flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


@dataclass
class BucketedReduction:
    """``parameters``' gradients summed over ``group`` and divided by ``divisor``, bucket by bucket as they are final.

    Buckets follow the reverse of the parameters' order (backward reaches the last-registered
    weights first), split by dtype and device and at ``bucket_bytes`` (default: this module's ``BUCKET_BYTES``).
    """

    parameters: Sequence[nn.Parameter]
    group: dist.ProcessGroup
    divisor: int = 1
    bucket_bytes: int | None = None
    buckets: list[_Bucket] = field(init=False, default_factory=list)
    launched: int = field(init=False, default=0)  # buckets launched this step (always a prefix)

    def __post_init__(self) -> None:
        self._bucket_of: dict[int, _Bucket] = {}
        limit = self.bucket_bytes or BUCKET_BYTES
        for param in reversed(list(self.parameters)):
            shape, dtype, device = _local_shape(param)
            numel = shape.numel()
            last = self.buckets[-1] if self.buckets else None
            full = last is not None and last.numel * last.dtype.itemsize >= limit
            if last is None or full or (last.dtype, last.device) != (dtype, device):
                last = _Bucket([], 0, dtype, device)
                self.buckets.append(last)
            last.params.append(param)
            last.numel += numel
            self._bucket_of[id(param)] = last
        self._reset()

    def _reset(self) -> None:
        self.launched = 0
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)

    def final(self, param: nn.Parameter) -> None:
        """``param``'s gradient will not change again this step: launch every bucket that is complete, in order."""
        self._bucket_of[id(param)].waiting -= 1
        while self.launched < len(self.buckets) and self.buckets[self.launched].waiting == 0:
            self.buckets[self.launched].launch(self.group)
            self.launched += 1

    def finish(self) -> None:
        """Launch what backward left (in order), wait for every bucket, and write the results into ``.grad``."""
        for bucket in self.buckets[self.launched :]:
            bucket.launch(self.group)
        for bucket in self.buckets:
            bucket.land(self.divisor)
        self._reset()
