"""Gradient norm and clipping over parameters sharded across a device mesh.

Why not ``torch.nn.utils.clip_grad_norm_``: it stacks the per-parameter norms into one
tensor, which fails when the parameters are DTensors on different meshes (a 1-D ``tp``
sub-mesh next to the 2-D ``(dp, tp)`` mesh), and it knows nothing about pipeline stages,
where each rank holds different parameters. Here every norm is computed on local tensors
and the pieces are combined with as few all-reduces as the layout allows:

- a gradient sharded along some mesh axes contributes ``sum |g_local|^p`` once per shard,
  which must be summed over exactly those axes' process groups;
- a replicated gradient (``Replicate()`` everywhere, or a plain tensor) is identical on the
  ranks that hold it and is counted once, with no communication at all;
- ``Partial`` gradients (sequence parallel norms) are reduced first (:mod:`._partial`);
- with ``pipeline_group``, the per-stage totals are summed over the stages last.

Gradients are grouped by the *set* of process groups they must be summed over; a group of
ranks appearing in several sets is all-reduced once, with one tensor holding every set it
belongs to. A tensor-parallel-only layout thus costs a single all-reduce of one number.

Assumption (true under ``HybridParallelStrategy``): the ranks of one process group hold
parameters with the same layout, so they agree on which groups to reduce over. Whether a
gradient is ``None`` does not matter: a parameter without a gradient still takes part in
the collectives, with a contribution of zero, so a rank whose expert got no tokens does not
hang the others.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_parallel.compat import StridedShard
from lightning_parallel.mesh import Axis
from lightning_parallel.precision._partial import (
    GroupRanks,
    comm_device,
    group_ranks,
    reduce_partial_grads_,
    unique_parameters,
)
from lightning_parallel.tensor_parallel.row_layout import row_layout

__all__ = ["clip_grad_norm_", "clip_grad_value_", "global_grad_norm"]


def global_grad_norm(
    parameters: Tensor | Iterable[Tensor],
    norm_type: float | str = 2.0,
    pipeline_group: ProcessGroup | None = None,
    *,
    error_if_nonfinite: bool = False,
    expert_group: ProcessGroup | None = None,
    expert_ids: set[int] | None = None,
) -> Tensor:
    """Return the norm of all gradients viewed as one vector: a float32 scalar, equal on every rank.

    Every rank of the job must call this together (it issues collectives). ``Partial``
    gradients are replaced in ``p.grad`` by their reduced value (same numbers, one all-reduce
    now instead of one later in the optimizer).

    Args:
        parameters: parameters (plain tensors or DTensors on any meshes) whose ``.grad`` to measure.
        norm_type: ``p`` of the p-norm, ``p > 0``, or ``inf`` / ``"inf"`` for the max norm.
        pipeline_group: the group of pipeline stages (``mesh[Axis.PP].get_group()``), over which
            totals are summed because each stage holds different parameters. ``None`` without
            pipeline parallelism.
        error_if_nonfinite: raise (on every rank alike) if the total norm is nan or inf.
        expert_group, expert_ids: under expert parallelism, the ``ep`` group and the ids of the
            parameters holding this rank's experts: each ep rank holds other experts under the same
            names (plain tensors, or FSDP2 shards over their replicas only), so their sums are also
            summed over ``expert_group``.
    """
    params = unique_parameters(parameters)
    p = _check_norm_type(norm_type)
    device = comm_device(params)
    reduce_partial_grads_(params)

    # Contributions per set of process groups to sum over; the empty set needs no collective.
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    contributions: dict[frozenset[GroupRanks], list[Tensor]] = defaultdict(list)
    groups: dict[GroupRanks, ProcessGroup] = {}
    for param in params:
        grad = param.grad
        # Keyed by the gradient's layout, or the parameter's when there is no gradient.
        key = _shard_groups(grad if grad is not None else param, groups)
        if expert_group is not None and expert_ids and id(param) in expert_ids:
            ranks = group_ranks(expert_group)
            groups.setdefault(ranks, expert_group)
            key = key | {ranks}
        entries = contributions[key]  # registers the key even without a gradient
        if grad is not None:
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            layout = row_layout(param)  # a row on several tensor-parallel ranks counts once
            entries.append(local if layout is None else layout.measured(local, p, _tp_rank(grad)))

    # Keys in order of first appearance: ranks of one group see the parameters in the same
    # order, so their entries line up (rank tuples of the *other* groups differ per rank).
    keys = list(contributions)
    # One spare zero entry, so that the max or sum over no gradients at all is 0.
    values = torch.zeros(len(keys) + 1, dtype=torch.float64, device=device)
    for index, key in enumerate(keys):
        values[index] = _local_power_sum(contributions[key], p, device)
    _reduce_over_groups(values, keys, groups, op)
    total = values.max() if math.isinf(p) else values.sum()

    if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
        dist.all_reduce(total, op=op, group=pipeline_group)
    norm = total if math.isinf(p) else total.pow(1.0 / p)
    norm = norm.to(torch.float32)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total gradient norm of order {norm_type} is non-finite ({norm.item()}), so it cannot be"
            " clipped. Set `error_if_nonfinite=False` to scale the gradients by the non-finite norm anyway."
        )
    return norm


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    pipeline_group: ProcessGroup | None = None,
    *,
    error_if_nonfinite: bool = False,
    norm_exclude: set[int] | None = None,
    expert_group: ProcessGroup | None = None,
    expert_ids: set[int] | None = None,
) -> Tensor:
    """Scale all gradients in place so that their global norm is at most ``max_norm``.

    ``norm_exclude``: ids of parameters that are scaled but not measured, because another
    rank measures the same weight (one tied across pipeline stages).

    Same arguments and result as :func:`global_grad_norm` (the norm before clipping). Every
    rank multiplies by the same coefficient, computed from the same replicated norm, so
    shards and replicas stay consistent. Like torch, the multiplication always happens
    (coefficient clamped to 1) to avoid a host sync on the norm.
    """
    params = unique_parameters(parameters)
    measured = [p for p in params if id(p) not in norm_exclude] if norm_exclude else params
    total_norm = global_grad_norm(
        measured,
        norm_type,
        pipeline_group,
        error_if_nonfinite=error_if_nonfinite,
        expert_group=expert_group,
        expert_ids=expert_ids,
    )
    coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for local in _local_grads(params):
        by_device_dtype[(local.device, local.dtype)].append(local)
    with torch.no_grad():
        for (device, _), locals_ in by_device_dtype.items():
            torch._foreach_mul_(locals_, coefficient.to(device))
    return total_norm


def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, on local shards.

    Elementwise, so no norm is needed; but a ``Partial`` gradient must be reduced first
    (clamping the addends is not clamping the sum), and ``torch.nn.utils.clip_grad_value_``
    cannot batch DTensors from different meshes.
    """
    params = unique_parameters(parameters)
    reduce_partial_grads_(params)
    value = float(clip_value)
    with torch.no_grad():
        for local in _local_grads(params):
            local.clamp_(min=-value, max=value)


def _check_norm_type(norm_type: float | str) -> float:
    p = float(norm_type)
    if not (p > 0):
        raise ValueError(
            f"`norm_type={norm_type!r}` is not supported: use a p-norm with p > 0 (2.0 is the usual one)"
            " or 'inf' for the max norm."
        )
    return p


def _shard_groups(tensor: Tensor, groups: dict[GroupRanks, ProcessGroup]) -> frozenset[GroupRanks]:
    """The process groups (by their ranks) over which a tensor's local pieces must be summed.

    Only mesh axes of size > 1 with a ``Shard`` placement count: along ``Replicate`` axes
    every rank holds the same values, which must be counted once, not once per rank.
    """
    if not isinstance(tensor, DTensor):
        return frozenset()
    mesh = tensor.device_mesh
    key = []
    for mesh_dim, placement in enumerate(tensor.placements):
        # _StridedShard (fused projections) is not a Shard subclass and answers is_shard() False
        # in torch 2.13, yet its local pieces partition the tensor like any shard.
        if (placement.is_shard() or isinstance(placement, StridedShard)) and mesh.size(mesh_dim) > 1:
            group = mesh.get_group(mesh_dim)
            ranks = group_ranks(group)
            groups.setdefault(ranks, group)
            key.append(ranks)
    return frozenset(key)


def _tp_rank(tensor: Tensor) -> int:
    """This rank's coordinate on the tensor-parallel axis of a DTensor's mesh (0 without one)."""
    if not isinstance(tensor, DTensor) or Axis.TP not in (tensor.device_mesh.mesh_dim_names or ()):
        return 0
    return tensor.device_mesh.get_local_rank(Axis.TP)


def _local_power_sum(tensors: list[Tensor], p: float, device: torch.device) -> Tensor:
    """``sum |x|^p`` over all elements (``max |x|`` for p = inf), in float64 to keep rtol ~1e-7."""
    # Grouped for the foreach kernel; empty shards (uneven sharding) contribute nothing, and
    # the inf-norm kernel refuses them.
    by_device_dtype: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        if tensor.numel() > 0:
            by_device_dtype[(tensor.device, tensor.dtype)].append(tensor)
    norms: list[Tensor] = [torch.zeros((), dtype=torch.float32, device=device)]
    for group in by_device_dtype.values():
        norms.extend(torch._foreach_norm(group, p, dtype=torch.float32))
    stacked = torch.stack([norm.to(device) for norm in norms]).to(torch.float64)
    return stacked.max() if math.isinf(p) else stacked.pow(p).sum()


def _reduce_over_groups(
    values: Tensor,
    keys: list[frozenset[GroupRanks]],
    groups: dict[GroupRanks, ProcessGroup],
    op: dist.ReduceOp,
) -> None:
    """All-reduce each entry of ``values`` over every group of its key: one collective per group.

    Groups are visited in one order that every rank derives alike (:func:`_axis_order`). Two
    properties depend on it. Correctness: a value sharded over two axes must be summed over
    the axes in the same sequence on every rank; were rank 0 to sum over ``tp`` then ``dp``
    while rank 2 sums over ``dp`` first, rank 0's ``dp`` partner would hand over a partial
    sum of the wrong stage (seen: wrong norms on a 2x2 mesh). Liveness: with one global
    order, ranks that share several groups can never wait on each other in a cycle.
    """
    for ranks in sorted(groups, key=_axis_order):
        indices = [index for index, key in enumerate(keys) if ranks in key]
        if not indices:
            continue
        index_tensor = torch.tensor(indices, device=values.device)
        selected = values.index_select(0, index_tensor)
        dist.all_reduce(selected, op=op, group=groups[ranks])
        values.index_copy_(0, index_tensor, selected)


def _axis_order(ranks: GroupRanks) -> tuple[int, tuple[int, ...], GroupRanks]:
    """Sort key of a group: its shape (size, rank offsets) first, then its ranks.

    Groups of one mesh axis have the same shape on every rank (``tp`` is ``(0, 1)`` in a
    row-major ``(dp, tp)`` mesh, ``dp`` is ``(0, tp)``) while their ranks differ, so sorting
    by shape makes every rank visit the axes in the same sequence; the ranks break ties, so
    the order stays total.
    """
    return len(ranks), tuple(rank - ranks[0] for rank in ranks), ranks


def _local_grads(params: list[Tensor]) -> list[Tensor]:
    """The local tensors of all gradients; in-place changes to them change the gradients."""
    locals_ = []
    for param in params:
        grad = param.grad
        if grad is not None:
            locals_.append(grad.to_local() if isinstance(grad, DTensor) else grad)
    return locals_
