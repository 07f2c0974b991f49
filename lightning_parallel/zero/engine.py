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


def release_engine(engine: Any) -> None:
    """Let the engine go with the strategy and the module once a Trainer call ends; its state stays for a
    checkpoint saved after ``fit`` (a later ``fit`` builds another engine).

    DeepSpeed keeps every engine for the life of the process. ZeRO-1/2 hook each parameter's gradient
    accumulator, a C++ autograd node whose hook holds the optimizer (and through it the engine, the
    module and the Trainer) where Python's collector cannot see it; the hooks serve only this engine's
    backward passes. ZeRO-3 appends the module to a module-level stack that nothing pops (its entry
    serves only this engine's forwards) and caches per submodule on its coordinator's class. On the lent
    H200, 19.6 GiB stayed allocated after a ZeRO-1 ``fit`` returned and its Trainer and module were deleted.
    """
    hooks = getattr(getattr(engine, "optimizer", None), "_grad_acc_hooks", None)
    if isinstance(hooks, list):
        for hook in hooks:
            hook.remove()
        hooks.clear()
    try:
        from deepspeed.runtime.zero import parameter_offload
    except ImportError:  # pragma: no cover - an engine exists only where deepspeed does
        return
    module, stack = getattr(engine, "module", None), getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if module is not None and isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]
    _clear_release_cache()


def _clear_release_cache() -> None:
    """ZeRO-3's coordinator caches which parameters to release in a ``functools.lru_cache`` on its class,
    keyed by the coordinator and each submodule: one cache for every engine of the process. Emptied, it
    fills again from the next step of an engine still in use."""
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except ImportError:  # pragma: no cover
        return
    method = getattr(
        PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None
    )
    # under DeepSpeed's nvtx decorator, which keeps the cached function in its closure
    for cached in [method, *(cell.cell_contents for cell in getattr(method, "__closure__", None) or ())]:
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
