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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.zero.arguments import ZeroArguments
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
