"""One number summed over every element of the whole model, whatever the layout holds where.

Pruning with a global threshold must count, for a candidate threshold, how many weights of the
*whole* model lie below it. Each rank holds only some of them: tensor-parallel shards (summed
over ``tp``), FSDP2 shards (summed over ``dp``), replicas (counted once), pipeline stages (summed
over ``pp``), expert slices (summed over ``ep``), rows stored on several tensor-parallel ranks
(counted once). The gradient norm solves the same problem for ``sum |g|^p``
(:mod:`.grad_norm`); this is its bookkeeping for any per-element quantity, many at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_parallel.precision._partial import GroupRanks, comm_device, group_ranks
from lightning_parallel.precision.grad_norm import _reduce_over_groups, _shard_groups, _tp_rank
from lightning_parallel.tensor_parallel.row_layout import row_layout

__all__ = ["LayoutSum", "local_values"]


def local_values(param: Tensor) -> Tensor:
    """The elements this rank stores of a parameter (a DTensor's local shard, else the tensor)."""
    return param.to_local() if isinstance(param, DTensor) else param


class LayoutSum:
    """Sums of per-element quantities over the whole model, each element counted exactly once.

    Built once for a list of parameters (their layout is fixed after setup). A call takes, per
    parameter, a tensor of its local values' shape (optionally with a trailing dimension of
    ``n`` columns) and returns the ``n`` global sums, equal on every rank. Every rank of the job
    must call it together.

    Args:
        params: the parameters, in the same order on every rank of a group (module order).
        pipeline_group: the ``pp`` group under pipeline parallelism: stages hold other parameters.
        expert_group, expert_ids: the ``ep`` group and this rank's expert parameters (other experts
            on the other ep ranks under the same names).
        exclude: ids of parameters another rank counts (a weight tied across pipeline stages).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        pipeline_group: ProcessGroup | None = None,
        expert_group: ProcessGroup | None = None,
        expert_ids: set[int] | None = None,
        exclude: set[int] | None = None,
    ) -> None:
        self.params = list(params)
        self.device = comm_device(self.params)
        self.pipeline_group = (
            pipeline_group if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1 else None
        )
        self.groups: dict[GroupRanks, ProcessGroup] = {}
        keys: list[frozenset[GroupRanks] | None] = []
        for param in self.params:
            if exclude and id(param) in exclude:
                keys.append(None)
                continue
            key = _shard_groups(param, self.groups)
            if expert_group is not None and expert_ids and id(param) in expert_ids:
                ranks = group_ranks(expert_group)
                self.groups.setdefault(ranks, expert_group)
                key = key | {ranks}
            keys.append(key)
        # Keys in order of first appearance (the ranks of one group list the parameters alike).
        self.keys = list(dict.fromkeys(key for key in keys if key is not None))
        self.slot = [None if key is None else self.keys.index(key) for key in keys]

    def __call__(self, per_param: Sequence[Tensor]) -> Tensor:
        """``per_param[i]``: a tensor like parameter ``i``'s local values, of shape ``local.shape + (n,)``
        or ``local.shape``; returns the ``n`` (or one) global sums in float64, equal on every rank."""
        if len(per_param) != len(self.params):
            raise ValueError(f"LayoutSum: {len(per_param)} tensors for {len(self.params)} parameters")
        width = max(
            (v.shape[-1] for v, p in zip(per_param, self.params, strict=True) if v.dim() > p.dim()), default=1
        )
        table = torch.zeros(len(self.keys) + 1, width, dtype=torch.float64, device=self.device)
        for param, slot, values in zip(self.params, self.slot, per_param, strict=True):
            if slot is None:
                continue
            values = values.to(torch.float64)
            layout = row_layout(param)
            if layout is not None and layout.duplicated:  # a row on several tp ranks counts once
                values = layout.measured(values, 1.0, _tp_rank(param))
            table[slot] += values.reshape(-1, width).sum(0).to(self.device)
        if self.keys:
            _reduce_rows_over_groups(table, self.keys, self.groups)
        total = table.sum(0)
        if self.pipeline_group is not None:
            dist.all_reduce(total, group=self.pipeline_group)
        return total


def _reduce_rows_over_groups(
    table: Tensor, keys: list[frozenset[GroupRanks]], groups: dict[GroupRanks, ProcessGroup]
) -> None:
    """Each row of ``table`` summed over every group of its key (the gradient norm's order of groups)."""
    flat = table[: len(keys)].reshape(-1)
    width = table.shape[1]
    # One entry per (key, column): the norm's reduction takes a vector of entries with their keys.
    expanded = [key for key in keys for _ in range(width)]
    _reduce_over_groups(flat, expanded, groups, dist.ReduceOp.SUM)
    table[: len(keys)] = flat.view(len(keys), width)
