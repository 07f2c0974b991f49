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
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel import compat
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


Engine = Literal["deepspeed", "fsdp2"]


def engine_for(
    zero: ZeroArguments,
    tensor_parallel: int,
    pipeline_parallel: int = 1,
    selective_checkpointing: bool = False,
    expert_parallel: int = 1,
) -> Engine | None:
    """Which engine runs ZeRO for this layout (docs/design.md, "ZeRO engines"); None without ZeRO.

    torch's FSDP2 (``fully_shard`` over ``dp``, as torchtitan) where DeepSpeed cannot: ZeRO-3 with
    tensor parallelism (its stage 3 partitions parameters in module hooks that do not know
    DTensors), and ZeRO-2/3 with
    pipeline stages (its stages 2/3 reduce inside per-backward hooks, once per micro-batch, which is
    why its own pipeline engine refuses them), and ZeRO-2/3 with expert parallelism (dense gradients
    must be averaged over the expert ranks before DeepSpeed's reduction over their replicas, which
    its per-backward hooks at stages 2/3 leave no room for; FSDP2 shards experts over their replicas
    in their own units). Every other stage and layout is DeepSpeed's engine, NVMe offload at stage 3
    with data parallelism only included (DeepSpeed swaps parameters and optimizer states); other NVMe
    layouts (stage 2, or any model parallelism) are FSDP2's, whose optimizer states go to NVMe while
    the sharded parameters stay in host memory (``zero/sharded_nvme_adam.py``). Partial offload
    (``offload_ratio`` < 1) is FSDP2's in every layout: DeepSpeed's Twin-Flow steps the part kept on
    the accelerator with its fused GPU Adam, which has no CPU build to test here. So is the delayed
    update (``offload_update="delayed"``), which steps FSDP2's host shards.
    """
    if not zero.enabled:
        return None
    if zero.engine == "fsdp2":
        return "fsdp2"
    chosen = _engine_by_layout(zero, tensor_parallel, pipeline_parallel, expert_parallel)
    if zero.engine == "deepspeed" and chosen != "deepspeed":
        raise ValueError(
            f"`zero_engine='deepspeed'` with `zero_stage={zero.stage}`, tensor_parallel={tensor_parallel},"
            f" pipeline_parallel={pipeline_parallel}, expert_parallel={expert_parallel}, offload={zero.offload!r},"
            f" offload_ratio={zero.offload_ratio}: DeepSpeed's engine cannot run this layout (docs/zero.md, ZeRO"
            " engines). Use `zero_engine='auto'` (FSDP2 here)."
        )
    return chosen


def _engine_by_layout(
    zero: ZeroArguments, tensor_parallel: int, pipeline_parallel: int, expert_parallel: int
) -> Engine:
    if zero.offload_ratio < 1:  # partial offload: one offload policy per FSDP2 unit (zero/fsdp.py)
        return "fsdp2"
    if zero.update == "delayed":  # the delayed host step runs on FSDP2's host shards (zero/delayed_update.py)
        return "fsdp2"
    if zero.offload == "nvme":
        model_parallel = tensor_parallel > 1 or pipeline_parallel > 1 or expert_parallel > 1
        return "fsdp2" if model_parallel or zero.stage == 2 else "deepspeed"
    if zero.stage == 3 and tensor_parallel > 1:
        return "fsdp2"
    if zero.stage > 1 and (pipeline_parallel > 1 or expert_parallel > 1):
        return "fsdp2"
    return "deepspeed"


def config_engine(config: Any, dims: Any) -> Engine | None:
    """:func:`engine_for` of a ``ParallelConfig`` on resolved ``ParallelDims``."""
    return engine_for(
        config.zero, dims.tensor_parallel, dims.pipeline_parallel, expert_parallel=dims.expert_parallel
    )


# The C++ ops a ZeRO job loads, and what for (DeepSpeed compiles each on first use, a minute or more).
_OPS = {
    "cpu_adam": "the optimizer step on the CPU (offload)",
    "async_io": "the NVMe swapping (offload='nvme')",
    "deepspeed_shm_comm": "DeepSpeed's collectives on the CPU",
}


def ops_to_compile(zero: ZeroArguments, device_type: str) -> list[str]:
    """The ops this job needs that torch's extension cache does not hold yet (they compile on first use)."""
    needed = (["cpu_adam"] if zero.offload else []) + (["async_io"] if zero.offload == "nvme" else [])
    needed += ["deepspeed_shm_comm"] if device_type == "cpu" else []
    missing = []
    for name in needed:
        if not (compat.extension_build_directory(name) / f"{name}.so").exists():
            missing.append(name)
    return missing


def announce_compilation(zero: ZeroArguments, device_type: str) -> str | None:
    """One line saying which ops are about to compile, why, and where they are cached (None: nothing to compile)."""
    missing = ops_to_compile(zero, device_type)
    if not missing:
        return None
    cache = os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")
    what = "; ".join(f"{name} ({_OPS[name]})" for name in missing)
    return (
        f"ZeRO: compiling DeepSpeed's C++ ops once, a minute or more each: {what}. Cached in {cache}"
        " (set TORCH_EXTENSIONS_DIR to keep one cache per environment); later runs load them in seconds."
    )


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
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    if (line := announce_compilation(zero, device_type)) is not None:
        rank_zero_info(line)
    nvme = (zero.offload_path, rank) if zero.offload == "nvme" and zero.offload_path is not None else None
    if zero.offload_ratio < 1:
        rank_zero_info(partial_offload_line(optimizers, zero))
    return [offload_optimizer(o, schedulers, sharded=True, nvme=nvme) for o in optimizers]


def partial_offload_line(optimizers: list[Any], zero: ZeroArguments) -> str:
    """What ``offload_ratio`` chose on this rank: the fraction of the optimizer's elements offloaded."""
    from lightning_parallel.zero.fsdp import KEPT_ON_DEVICE

    params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    kept = sum(p.numel() for p in params if getattr(p, KEPT_ON_DEVICE, False))
    total = sum(p.numel() for p in params) or 1
    return (
        f"ZeRO partial offload (`offload_ratio={zero.offload_ratio}`): {1 - kept / total:.0%} of the parameters"
        f" have their optimizer states and step offloaded to {zero.offload} (whole FSDP2 units, the nearest to the"
        " ratio), the rest stay on the device with torch's Adam."
    )
