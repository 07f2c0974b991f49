"""Which engine runs ZeRO for a layout: DeepSpeed's or torch's FSDP2, decided once from the arguments and degrees."""

from __future__ import annotations

from typing import Any, Literal

from lightning_parallel.zero.arguments import ZeroArguments

__all__ = ["Engine", "config_engine", "engine_for"]


Engine = Literal["deepspeed", "fsdp2"]


def engine_for(
    zero: ZeroArguments,
    tensor_parallel: int,
    pipeline_parallel: int = 1,
    *,
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
    the accelerator with its fused GPU Adam, which has no CPU build to test here. So are the delayed
    update and the importance split (``offload_update``), which step FSDP2's host shards, and
    ``zero_gather_dtype="compute"``, FSDP2's cast of the shards before their all-gather.
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
    if zero.update != "exact":  # the delayed update and the importance split step FSDP2's host shards
        return "fsdp2"
    if zero.gather_dtype == "compute":  # FSDP2's MixedPrecisionPolicy casts before its all-gather
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
