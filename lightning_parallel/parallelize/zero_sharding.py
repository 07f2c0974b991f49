"""The recipe's ZeRO step: the parameters ZeRO's engine takes, made before the pipeline's stages capture them."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.config import ParallelConfig
from lightning_parallel.mesh import Axis, ParallelDims
from lightning_parallel.pipeline.stages import SkippedBlock
from lightning_parallel.zero.engine_choice import Engine
from lightning_parallel.zero.fsdp import ExpertSharding, Sharded, fully_shard_modules
from lightning_parallel.zero.tensor_parallel import local_shard_parameters

__all__ = ["shard_for_zero"]


def shard_for_zero(
    module: nn.Module,
    config: ParallelConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    blocks: list[str],
    *,
    engine: Engine | None,
    gather_dtype: torch.dtype | None = None,
) -> Sharded | None:
    """The parameters ZeRO's engine takes, before the pipeline's stages exist (they capture the parameters).

    FSDP2 (``zero/engine_choice.py: engine_for``): ``fully_shard`` the blocks this rank holds and the rest.
    DeepSpeed with tensor parallelism: each DTensor weight re-registered as its plain local shard
    (returns None, as without ZeRO). ``gather_dtype``: FSDP2's units gather their parameters in it
    (``zero_gather_dtype="compute"``; None: as stored).
    """
    # DeepSpeed flattens plain tensors (zero/tensor_parallel.py)
    if engine == "deepspeed" and dims.tp_enabled:
        local_shard_parameters(module)
    if engine != "fsdp2":
        return None

    kept = [module.get_submodule(b) for b in blocks if not isinstance(module.get_submodule(b), SkippedBlock)]
    # Gathered once per step under stages (not once per micro-batch) unless the user asks for the memory;
    # ZeRO-3 alone reshards after forward.
    reshard = config.zero.stage == 3 and (not dims.pp_enabled or config.zero.reshard == "micro_batch")
    # Experts over their replicas (dp_replicate), everything else over the whole dp (zero/fsdp.py).
    experts = ExpertSharding(mesh[Axis.DP_REPLICATE], dims.data_parallel) if dims.ep_enabled else None
    return fully_shard_modules(
        module,
        mesh[Axis.DP],
        kept,
        offload=config.zero.offload is not None,
        reshard_after_forward=reshard,
        experts=experts,
        offload_ratio=config.zero.offload_ratio,
        gather_dtype=gather_dtype,
    )
