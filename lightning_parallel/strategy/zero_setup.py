"""DeepSpeed's ZeRO engine for the strategy: the parallelized module and the user's optimizer handed to it."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_parallel.config.validation import check_zero_optimizers, importance_split_refusal
from lightning_parallel.strategy.checkpointing import CheckpointingStrategy
from lightning_parallel.zero.arguments import describe_compute
from lightning_parallel.zero.deepspeed_ops import announce_compilation
from lightning_parallel.zero.engine import deepspeed_environment, initialize_engine
from lightning_parallel.zero.fsdp import gather_dtype_for, shard_states, unit_parameters
from lightning_parallel.zero.optimizer import offload_sharded_optimizers
from lightning_parallel.zero.overlapped_step import OverlappedHostStep, overlap_refusal


def initialize_zero(strategy: CheckpointingStrategy, trainer: Trainer, *, pipelined: bool) -> None:
    """``deepspeed.initialize`` on the module the recipe parallelized; the engine's optimizer replaces the user's.

    Without pipeline stages the steps run through ``engine.forward`` (the engine becomes the strategy's
    model); under stages the runner drives the module and the engine only steps.
    """
    zero = strategy.config.zero
    check_zero_optimizers(zero, len(strategy.optimizers), len(strategy.lr_scheduler_configs), trainer)
    env = strategy.cluster_environment
    assert env is not None and strategy.lightning_module is not None
    deepspeed_environment(
        strategy.global_rank, strategy.world_size, strategy.local_rank, env.main_address, env.main_port
    )
    if (line := announce_compilation(zero, strategy.root_device.type)) is not None:
        rank_zero_info(line)
    engine, optimizer, mpu = initialize_engine(
        strategy.lightning_module,
        strategy.optimizers[0],
        [c.scheduler for c in strategy.lr_scheduler_configs],
        zero,
        strategy.device_mesh,
        strategy.precision_plugin.precision,
        trainer.gradient_clip_val,
        strategy._process_group_backend,
        strategy._timeout,
    )
    strategy.zero_engine = engine
    strategy.optimizers = [optimizer]
    if not pipelined:
        strategy.model = engine
    precision = strategy.precision_plugin.precision
    if (warning := zero.precision_override(precision)) is not None:
        rank_zero_warn(warning)
    compute = "as `deepspeed_config` says" if warning else describe_compute(precision)
    rank_zero_info(
        f"{type(strategy).__name__}: ZeRO stage {zero.stage} on DeepSpeed's engine"
        + (f", offload {zero.offload}" if zero.offload else "")
        + f", sharded over {mpu.get_data_parallel_world_size()} data-parallel ranks; computes {compute}"
    )


def announce_fsdp(strategy: CheckpointingStrategy) -> None:
    """The setup log's line for ZeRO on FSDP2: what it shards, over how many ranks, and in which dtypes."""
    zero, precision = strategy.config.zero, strategy.precision_plugin.precision
    gathered = gather_dtype_for(zero, precision)
    gathers = "as stored" if gathered is None else f"in {str(gathered).removeprefix('torch.')}"
    rank_zero_info(
        f"{type(strategy).__name__}: ZeRO stage {zero.stage} on FSDP2"
        + (f", offload {zero.offload}" if zero.offload else "")
        + f", parameters gathered {gathers}; computes {describe_compute(precision)}"
    )


def initialize_fsdp_offload(strategy: CheckpointingStrategy, trainer: Trainer) -> OverlappedHostStep | None:
    """FSDP2's shards on the host: Adam/AdamW become DeepSpeed's CPU Adam on them, and where exact each shard's
    step starts during backward (the returned overlap; None where it cannot)."""
    # before DeepSpeed's CPU Adam is built: a refusal must not meet a rank loading it
    if strategy.dims is not None:
        refusal = importance_split_refusal(strategy.config.zero.update, strategy.dims.tensor_parallel)
        if refusal is not None:
            raise ValueError(refusal)
    if (line := announce_compilation(strategy.config.zero, strategy.root_device.type)) is not None:
        rank_zero_info(line)
    strategy.optimizers = offload_sharded_optimizers(
        strategy.optimizers, strategy.lr_scheduler_configs, strategy.config.zero, strategy.global_rank
    )
    if strategy.config.zero.update != "exact":
        attach_deferred_update(strategy)
        return None
    return initialize_host_step_overlap(strategy, trainer)


def attach_deferred_update(strategy: CheckpointingStrategy) -> None:
    """``offload_update="delayed"`` or an :class:`ImportanceSplit`: the optimizer's step follows that update's rule
    (``zero/delayed_update.py``, ``zero/importance_split.py``), torch's fused Adam on the host shards."""
    # lazy: the three import deepspeed (through zero/sharded_cpu_adam.py), needed only with offload
    from lightning_parallel.zero.delayed_update import DelayedUpdate
    from lightning_parallel.zero.importance_split import ImportanceSplitUpdate
    from lightning_parallel.zero.sharded_cpu_adam import torch_adam_refusal

    update = strategy.config.zero.update
    for optimizer in [getattr(o, "_optimizer", o) for o in strategy.optimizers]:
        if (refusal := torch_adam_refusal(optimizer)) is not None:
            raise ValueError(
                f"`offload_update={update!r}` with {refusal}. That host step is torch's fused Adam on fp32"
                " parameters: return torch.optim.Adam or AdamW from `configure_optimizers` (bias correction on), use"
                " `precision='bf16-mixed'` rather than 'bf16-true', or leave `offload_update='exact'`."
            )
        vars(optimizer)["deferred_update"] = (
            DelayedUpdate(optimizer) if update == "delayed" else ImportanceSplitUpdate(optimizer, update)
        )
    if update == "delayed":
        rank_zero_info(
            "ZeRO offload (`offload_update='delayed'`): each step installs the previous step's update and computes"
            " its own on the host during the next forward and backward, which use the parameters one update behind"
            " (ZeRO-Offload's delayed parameter update: not the one-process run's training)."
        )
    else:
        rank_zero_info(
            f"ZeRO offload (`offload_update={update!r}`): at each step the {update.top_rows:.0%} of each matrix's"
            f" rows with the largest gradients are updated at once; the others' gradients are summed on the host and"
            f" applied every {update.update_interval} steps during the next forward and backward (not the one-process"
            " run's training)."
        )


def initialize_host_step_overlap(
    strategy: CheckpointingStrategy, trainer: Trainer
) -> OverlappedHostStep | None:
    """ZeRO on FSDP2 with ``offload="cpu"``: the host step of each offloaded shard during backward, where exact
    (``zero/overlapped_step.py``); the setup log says whether it engaged and, if not, why."""

    parallelized = strategy.parallelized
    module = strategy.lightning_module
    if parallelized is None or module is None or len(strategy.optimizers) != 1:
        return None
    optimizer = getattr(strategy.optimizers[0], "_optimizer", strategy.optimizers[0])
    zero = strategy.config.zero
    refusal = overlap_refusal(
        optimizer,
        gradient_clip_val=trainer.gradient_clip_val,
        clipping_overridden=is_overridden("configure_gradient_clipping", module),
        loss_scaled=getattr(strategy.precision_plugin, "scaler", None) is not None,
        reduced_per_micro_batch=parallelized.pipeline is not None and zero.reshard == "micro_batch",
    )
    if refusal is not None:
        rank_zero_info(f"ZeRO offload: the host optimizer steps after backward: {refusal}.")
        return None
    params = host_step_parameters(strategy)
    if not params:
        return None
    rank_zero_info(
        f"ZeRO offload: the host optimizer steps each of {len(params)} offloaded tensors as soon as backward has"
        " reduced its gradient, while the backward of the layers below still runs (exact: no clipping or loss"
        " scale needs the whole backward first)."
    )
    return OverlappedHostStep(optimizer, params, shard_states(parallelized.gradients.fsdp_units))


def host_step_parameters(strategy: CheckpointingStrategy) -> dict[str, Any]:
    """The parameters whose host step may start during backward, by name: FSDP2's offloaded shards, minus those
    an explicit reduction changes after backward (their gradients are final only then)."""
    from lightning_parallel.zero.sharded_cpu_adam import offloaded  # imports DeepSpeed: only with offload

    parallelized = strategy.parallelized
    assert parallelized is not None and strategy.lightning_module is not None
    late = parallelized.gradients.changed_after_backward()
    names = {id(p): name for name, p in strategy.lightning_module.named_parameters()}
    return {
        names[id(p)]: p
        for unit in parallelized.gradients.fsdp_units
        for p in unit_parameters(unit)
        if offloaded(p) and p.requires_grad and id(p) not in late and id(p) in names
    }
