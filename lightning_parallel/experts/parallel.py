"""Expert parallelism: keep this rank's experts, send tokens to the others' with all-to-all.

    blocks = ExpertParallel.apply(model, ep_group, token_group=dp_group)
    expert_params = expert_parameters(model)     # {name: parameter}: reduce over expert replicas only

``apply`` converts, in place, every MoE block ``find_moe_blocks`` sees: this library's ``MoE``,
Hugging Face's fused experts (Mixtral, Qwen2-MoE in transformers 5) and generic blocks with a
router and a ``ModuleList`` of experts. Experts are sharded contiguously over the P ranks of
``ep_group``: rank d keeps experts ``[d * E / P, (d + 1) * E / P)``.

Parameter names stay the user's (checkpoint keys, optimizer groups and plans keep working):

- stacked weights (``MoE``'s ``experts.w_in``/``w_out``/``b_in``/``b_out``, HF's
  ``experts.gate_up_proj``/``down_proj``): same name, the local slice along dim 0, e.g.
  ``w_in`` of shape ``(E / P, H, F)`` holding experts ``[d * E / P, (d + 1) * E / P)``. The full
  tensor is the concatenation of the ranks' slices along dim 0 in ep-rank order.
- ``ModuleList`` experts: the non-local experts are removed; the local ones keep their global
  index in the name (``experts.5.w1.weight`` lives on the rank holding expert 5).

Each expert parameter carries an :class:`ExpertShard` (``expert_shard(param)``) saying which part
of the global tensor it is, for resharding checkpoints to another ``expert_parallel``.

Gradients: after backward, an expert parameter's gradient holds the contributions of the tokens
of all ranks of its ep group. Reduce it with a SUM over the expert-replica group (the ranks with
the same ep rank) and divide by the data-parallel size (all replicas, not the replica-group size);
the router and everything else is averaged over the data-parallel group as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_parallel.experts.detection import SHARD_ATTR, MoEBlockInfo, find_moe_blocks, per_expert
from lightning_parallel.experts.dispatch import ProcessGroup, group_rank, group_size, sum_in_place
from lightning_parallel.experts.foreign import (
    adapt_fused_experts,
    adapt_module_list,
    check_fused_experts,
    check_module_list,
)
from lightning_parallel.experts.grouped_linear import adapt_grouped_linears, check_grouped_linears
from lightning_parallel.experts.layer import MoE
from lightning_parallel.experts.prescaled import adapt_prescaled_experts, check_prescaled_experts

_SHARD_ATTR = SHARD_ATTR


@dataclass(frozen=True)
class ExpertShard:
    """Which part of the global expert tensor a parameter holds.

    ``dim`` is the expert dimension of a stacked weight (0); the parameter holds global experts
    ``[first_expert, first_expert + num_local)`` of ``num_experts``. For a ``ModuleList`` expert's
    parameter ``dim`` is None and the parameter is the whole tensor of expert ``first_expert``.
    """

    num_experts: int
    first_expert: int
    num_local: int
    ep_rank: int
    ep_size: int
    dim: int | None = 0
    rows_per_expert: int = 1  # a 2-D stack of experts' row blocks (DBRX's ``w1`` (E * F, H)): F rows each

    @property
    def global_rows(self) -> int:
        """The stacked tensor's size along ``dim`` (the experts, or their rows)."""
        return self.num_experts * self.rows_per_expert

    @property
    def local_rows(self) -> int:
        return self.num_local * self.rows_per_expert

    @property
    def first_row(self) -> int:
        return self.first_expert * self.rows_per_expert


def expert_shard(param: torch.Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` of a parameter converted by :meth:`ExpertParallel.apply`, else None."""
    return getattr(param, _SHARD_ATTR, None)


def _check_divisible(info: MoEBlockInfo, ep_size: int) -> None:
    if info.num_experts % ep_size:
        raise ValueError(
            f"ExpertParallel: {info.name or type(info.block).__name__} has {info.num_experts} experts, which"
            f" expert_parallel={ep_size} does not divide: experts are sharded evenly. Choose expert_parallel"
            f" among {[d for d in range(1, info.num_experts + 1) if info.num_experts % d == 0]}."
        )


def _slice_stacked(
    owner: nn.Module, names: list[str], num_experts: int, rank: int, size: int, rows_per_expert: int = 1
) -> None:
    """Replace each stacked parameter ``owner.<name>`` by its local slice along dim 0, same name.

    With one rank the parameter is kept (no copy) and only marked.
    """
    num_local = num_experts // size
    shard = ExpertShard(
        num_experts, rank * num_local, num_local, rank, size, dim=0, rows_per_expert=rows_per_expert
    )
    for dotted in names:  # also a child's (ERGO's per-expert norm inside the experts module)
        path, _, name = dotted.rpartition(".")
        holder = owner.get_submodule(path) if path else owner
        full = getattr(holder, name)
        if full is None:
            continue
        if full.shape[0] != shard.global_rows:
            raise ValueError(
                f"ExpertParallel: parameter {name!r} of {type(owner).__name__} has leading dimension"
                f" {full.shape[0]}, not the number of experts {num_experts} times {rows_per_expert}."
            )
        local = full
        if size > 1:
            local = nn.Parameter(
                full.detach()[shard.first_row : shard.first_row + shard.local_rows].clone(),
                requires_grad=full.requires_grad,
            )
            setattr(holder, name, local)
        setattr(local, _SHARD_ATTR, shard)


def _mark_module_list(info: MoEBlockInfo, rank: int, size: int) -> None:
    for index, expert in info.experts.named_children():
        shard = ExpertShard(info.num_experts, int(index), 1, rank, size, dim=None)
        for param in expert.parameters():
            setattr(param, _SHARD_ATTR, shard)


def _apply_to_moe(layer: MoE, ep_group: ProcessGroup | None, token_group: ProcessGroup | None) -> None:
    size, rank = group_size(ep_group), group_rank(ep_group)
    experts = layer.experts
    _slice_stacked(experts, ["w_in", "w_out", "b_in", "b_out"], layer.num_experts, rank, size)
    experts.num_experts = layer.num_experts // size
    layer.ep_group = ep_group if size > 1 else None
    layer.token_group = token_group if group_size(token_group) > 1 else None


class ExpertParallel:
    """Namespace for :meth:`apply` (a class so the strategy can refer to one object)."""

    @staticmethod
    def apply(
        module: nn.Module, ep_group: ProcessGroup | None, token_group: ProcessGroup | None = None
    ) -> list[MoEBlockInfo]:
        """Shard the experts of every MoE block in ``module`` over ``ep_group``; in place.

        Args:
            module: A model, or one MoE block. Run it on every rank of ``ep_group`` with the same
                initial weights (each rank keeps its slice of the same tensors).
            ep_group: The expert-parallel group (size P; P must divide every block's expert
                count). ``None`` or size 1: experts stay whole (only ``token_group`` is set).
            token_group: Ranks whose local batches together make the batch the model would see in
                one process: the data-parallel group (which contains ``ep_group``). Capacity,
                drop priority and the load-balancing statistics of ``MoE`` layers are then those
                of that global batch. ``None``: per rank.

        Returns the blocks converted. Raises ``ValueError`` (before changing anything) if P does
        not divide a block's expert count, or a generic block's routing cannot be reproduced.
        """
        blocks = find_moe_blocks(module)
        size, rank = group_size(ep_group), group_rank(ep_group)
        for info in blocks:
            _check_divisible(info, size)
            if any(expert_shard(p) is not None for p in info.experts.parameters()):
                raise ValueError(
                    f"ExpertParallel: {info.name or type(info.block).__name__} is already expert-parallel."
                )
            if size > 1 and info.kind == "module_list":
                check_module_list(info)  # every block checked before any is changed
            if size > 1 and info.kind == "fused":
                check_fused_experts(info)
            if size > 1 and info.kind == "prescaled":
                check_prescaled_experts(info)
            if size > 1 and info.kind == "grouped_linear":
                check_grouped_linears(info)
        for info in blocks:
            if info.kind == "lightning_parallel":
                _apply_to_moe(info.block, ep_group, token_group)
            elif info.kind == "grouped_linear":
                for name in info.grouped_names:
                    linear = getattr(info.block, name)
                    names = [n for n, p in linear.named_parameters() if per_expert(p, info.num_experts)]
                    _slice_stacked(linear, names, info.num_experts, rank, size)
                if size > 1:
                    adapt_grouped_linears(info, ep_group)
            elif info.kind in ("fused", "prescaled"):
                experts = info.experts
                rows = info.rows_per_expert
                names = [n for n, p in experts.named_parameters() if per_expert(p, info.num_experts, rows)]
                _slice_stacked(experts, names, info.num_experts, rank, size, rows)
                if size > 1:
                    adapt = adapt_fused_experts if info.kind == "fused" else adapt_prescaled_experts
                    adapt(info, ep_group)
            else:
                if size > 1:
                    adapt_module_list(info, ep_group)
                _mark_module_list(info, rank, size)
        return blocks


def reduce_expert_gradients(
    params: list[torch.Tensor], replica_group: ProcessGroup | None, data_parallel_size: int
) -> None:
    """Data-parallel reduction of expert gradients: sum over ``replica_group``, / ``data_parallel_size``.

    ``replica_group``: the ranks holding the same experts (same ep rank, other ep groups);
    ``None`` when there is one ep group. One coalesced all-reduce. Parameters without a gradient
    are skipped (they must be the same on every rank of the group).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    sum_in_place(grads, replica_group)
    for g in grads:
        g.div_(data_parallel_size)


def expert_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Expert parameters of ``module`` by name: the ones whose gradients skip the expert ranks.

    After :meth:`ExpertParallel.apply`, the parameters it converted (identified by their
    :class:`ExpertShard`, so the answer survives wrappers that rename modules); before it, those
    of the experts of every block ``find_moe_blocks`` finds. Routers and shared experts are not
    expert parameters: they are replicated like the rest of the model.
    """
    marked = {n: p for n, p in module.named_parameters() if expert_shard(p) is not None}
    if marked:
        return marked
    found = {name for info in find_moe_blocks(module) for name in info.expert_param_names}
    return {n: p for n, p in module.named_parameters() if n in found}
