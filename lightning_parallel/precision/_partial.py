"""Shared helpers for gradient maths on DTensors: reducing ``Partial`` gradients, group identity.

A ``Partial`` gradient (a replicated norm weight under sequence parallelism: each rank saw
a slice of the sequence) holds addends whose sum is the gradient. Norms and clamps are not
linear, so they need the sum; the optimizer would reduce it anyway when it adds the
gradient to the ``Replicate`` parameter. Reducing here, batched into one all-reduce per
(group, reduce op, dtype), and storing the result back in ``p.grad`` costs nothing extra.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Partial, Replicate

GroupRanks = tuple[int, ...]
"""The global ranks of a process group: its identity, the same on every member."""

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def unique_parameters(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    """Parameters as a list without repeats: a tied weight listed twice is measured and scaled once."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    seen: set[int] = set()
    unique = []
    for param in parameters:
        if id(param) not in seen:
            seen.add(id(param))
            unique.append(param)
    return unique


def group_ranks(group: ProcessGroup) -> GroupRanks:
    return tuple(dist.get_process_group_ranks(group))


def comm_device(params: list[Tensor]) -> torch.device:
    """Where to keep the scalars that are all-reduced: with the parameters (NCCL needs CUDA)."""
    for param in params:
        return param.device
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_partial_grads_(params: list[Tensor]) -> None:
    """Replace every gradient with ``Partial`` placements by its reduced DTensor, in place.

    One all-reduce per (group, reduce op, dtype), visited in the same order on every rank.
    A gradient partial along several mesh axes is reduced one axis per round.
    """
    while True:
        buckets: dict[tuple[GroupRanks, str, str], list[tuple[Tensor, int]]] = defaultdict(list)
        groups: dict[GroupRanks, ProcessGroup] = {}
        for param in params:
            grad = param.grad
            if not isinstance(grad, DTensor):
                continue
            for mesh_dim, placement in enumerate(grad.placements):
                if isinstance(placement, Partial):
                    group = grad.device_mesh.get_group(mesh_dim)
                    ranks = group_ranks(group)
                    groups.setdefault(ranks, group)
                    reduce_op = placement.reduce_op
                    buckets[(ranks, reduce_op, str(grad.dtype))].append((param, mesh_dim))
                    break  # one axis per round, the next round takes the next partial axis
        if not buckets:
            return
        for key in sorted(buckets):
            ranks, reduce_op, _ = key
            _reduce_bucket(buckets[key], groups[ranks], reduce_op)


def _reduce_bucket(entries: list[tuple[Tensor, int]], group: ProcessGroup, reduce_op: str) -> None:
    if reduce_op not in _REDUCE_OPS:
        raise NotImplementedError(f"Cannot reduce a gradient with placement Partial({reduce_op!r}).")
    grads = [param.grad for param, _ in entries]
    locals_ = [grad.to_local() for grad in grads]  # type: ignore[union-attr]
    with torch.no_grad():
        flat = torch.cat([local.reshape(-1) for local in locals_])
        if dist.get_world_size(group) > 1:
            dist.all_reduce(flat, op=_REDUCE_OPS[reduce_op], group=group)
            if reduce_op == "avg":
                flat.div_(dist.get_world_size(group))
        offset = 0
        for (param, mesh_dim), grad, local in zip(entries, grads, locals_, strict=True):
            numel = local.numel()
            local.copy_(flat[offset : offset + numel].view(local.shape))
            offset += numel
            assert isinstance(grad, DTensor)
            placements = list(grad.placements)
            assert isinstance(placements[mesh_dim], Partial)
            placements[mesh_dim] = Replicate()
            param.grad = DTensor.from_local(
                local, grad.device_mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride()
            )
