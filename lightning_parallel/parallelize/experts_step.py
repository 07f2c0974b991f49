"""Expert parallelism in the recipe: shard the experts of every MoE block, and collect auxiliary losses.

Experts are sharded over the ``ep`` axis, carved out of the data-parallel ranks
(``dp = dp_replicate x ep``, as in Megatron and DeepSpeed-MoE); tokens travel to their expert's
rank with all-to-all (``lightning_parallel.experts``). Their gradients need their own reduction,
decided with every other one in ``parallelize/reductions.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.config import ExpertConfig
from lightning_parallel.experts import AuxLossCollector, ExpertParallel, expert_parameters, find_moe_blocks
from lightning_parallel.mesh import Axis, ParallelDims


@dataclass
class ExpertState:
    """What the later steps and the hooks need to know about the experts."""

    parameter_ids: set[int] = field(default_factory=set)
    """Ids of the parameters that hold this rank's experts (reduced over their replicas only; their norms
    summed over ``ep`` too), read once every step that replaces parameters has run (ZeRO on FSDP2 shards
    them): :func:`expert_parameter_ids`."""
    aux_losses: AuxLossCollector | None = None
    """The MoE auxiliary losses injected into backward (``moe_aux_loss_coef``, or pipelined MoE layers)."""


def apply_experts(
    module: nn.Module,
    config: ExpertConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
) -> AuxLossCollector | None:
    """Shard the experts of every MoE block this rank holds; return the auxiliary-loss collector (if any)."""
    aux_losses = None
    if dims.ep_enabled:
        blocks = ExpertParallel.apply(
            module, mesh[Axis.EP].get_group(), token_group=mesh[Axis.DP].get_group()
        )
        if not blocks and not dims.pp_enabled:
            raise ValueError(
                f"`expert_parallel={dims.expert_parallel}`: {type(module).__name__} has no Mixture-of-Experts"
                " block (a router and a set of identical experts) to shard. Leave `expert_parallel=1`."
            )
        rank_zero_info(
            f"Expert parallel: {len(blocks)} MoE blocks on this rank, experts sharded over ep={dims.expert_parallel}"
        )
    moe_blocks = find_moe_blocks(module)
    # Under pipeline parallelism the last stage cannot reach the aux losses of the MoE layers of
    # other stages, so every layer's is injected into its own backward (counted once: the
    # user's ``moe_aux_loss`` then gets 0 for it); foreign blocks only with a coefficient.
    own_layers = dims.pp_enabled and any(b.kind == "lightning_parallel" for b in moe_blocks)
    if moe_blocks and (config.aux_loss_coef is not None or own_layers):
        group = mesh[Axis.DP].get_group() if mesh[Axis.DP].size() > 1 else None
        # under sequence parallelism each tp rank routes its own slice of the sequence (plans/auto.py)
        sequence = mesh[Axis.TP].get_group() if sequence_parallel and dims.tp_enabled else None
        aux_losses = AuxLossCollector(
            module,
            coef=config.aux_loss_coef or 0.0,
            z_loss_coef=config.z_loss_coef,
            token_group=group,
            mode="backward",
            sequence_group=sequence,
        )
    return aux_losses


def expert_parameter_ids(module: nn.Module, dims: ParallelDims) -> set[int]:
    """Ids of the parameters holding this rank's experts as the module holds them now (none without ``ep``)."""
    return {id(p) for p in expert_parameters(module).values()} if dims.ep_enabled else set()
