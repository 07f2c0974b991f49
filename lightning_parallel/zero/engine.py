"""DeepSpeed's engine over the mesh's data-parallel ranks: what ``deepspeed.initialize`` is given.

The strategy shards tensors, cuts stages and places experts (``parallelize/``); DeepSpeed then
takes the result as it is (the mesh as ``mpu``) and owns what ZeRO is about: partitioned
optimizer states, gradients and parameters, their offloading, the fp32 master weights, the loss
scale and clipping. Lightning keeps the loop: ``configure_optimizers``, LR schedulers,
accumulation, ``gradient_clip_val`` and the precision flag are translated, not replaced
(``zero/arguments.py``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.zero.arguments import ZeroArguments
from lightning_parallel.zero.deepspeed_ops import announce_compilation
from lightning_parallel.zero.fsdp import KEPT_ON_DEVICE
from lightning_parallel.zero.groups import MeshParallelUnit
from lightning_parallel.zero.optimizer import offload_optimizer


def deepspeed_environment(
    rank: int, world_size: int, local_rank: int, main_address: str, main_port: int
) -> None:
    """DeepSpeed reads the ranks from the environment (else it tries MPI); Lightning's launchers may not set them."""
    values = {
        "RANK": rank,
        "WORLD_SIZE": world_size,
        "LOCAL_RANK": local_rank,
        "MASTER_ADDR": main_address,
        "MASTER_PORT": main_port,
    }
    for key, value in values.items():
        os.environ.setdefault(key, str(value))


def initialize_engine(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedulers: list[Any],
    zero: ZeroArguments,
    mesh: DeviceMesh,
    precision: str,
    gradient_clip_val: float | None,
    backend: str | None,
    timeout: timedelta | None,
) -> tuple[Any, Any, MeshParallelUnit]:
    """``(engine, ZeRO optimizer, mpu)`` for the parallelized ``module`` and the user's one optimizer.

    With ``offload``, Adam/AdamW become DeepSpeed's CPU Adam (``schedulers`` are re-pointed to it).
    """
    import deepspeed

    mpu = MeshParallelUnit(mesh)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    if zero.offload is not None:
        optimizer = offload_optimizer(optimizer, schedulers)
    engine, zero_optimizer, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        config=zero.deepspeed_config(
            precision,
            gradient_clip_val,
            largest_parameter=max((p.numel() for p in module.parameters()), default=1),
        ),
        mpu=mpu,
        dist_init_required=False,
    )
    return engine, zero_optimizer, mpu


def offload_sharded_optimizers(
    optimizers: list[Any], scheduler_configs: list[Any], zero: ZeroArguments, device_type: str, rank: int
) -> list[Any]:
    """FSDP2 with ``offload``: Adam/AdamW become DeepSpeed's CPU Adam on the CPU shards (the LR schedulers
    of Lightning's ``scheduler_configs`` re-pointed), their states in files of ``offload_path`` with
    ``"nvme"``; other optimizers stay (refused with ``"nvme"``)."""
    schedulers = [config.scheduler for config in scheduler_configs]

    if (line := announce_compilation(zero, device_type)) is not None:
        rank_zero_info(line)
    nvme = (zero.offload_path, rank) if zero.offload == "nvme" and zero.offload_path is not None else None
    if zero.offload_ratio < 1:
        rank_zero_info(partial_offload_line(optimizers, zero))
    return [offload_optimizer(o, schedulers, sharded=True, nvme=nvme) for o in optimizers]


def partial_offload_line(optimizers: list[Any], zero: ZeroArguments) -> str:
    """What ``offload_ratio`` chose on this rank: the fraction of the optimizer's elements offloaded."""
    params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    kept = sum(p.numel() for p in params if getattr(p, KEPT_ON_DEVICE, False))
    total = sum(p.numel() for p in params) or 1
    return (
        f"ZeRO partial offload (`offload_ratio={zero.offload_ratio}`): {1 - kept / total:.0%} of the parameters"
        f" have their optimizer states and step offloaded to {zero.offload} (whole FSDP2 units, the nearest to the"
        " ratio), the rest stay on the device with torch's Adam."
    )
