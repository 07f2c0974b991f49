"""DeepSpeed's ZeRO engine for the strategy: the parallelized module and the user's optimizer handed to it."""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_parallel.config.validation import check_zero_optimizers
from lightning_parallel.strategy.checkpointing import CheckpointingStrategy
from lightning_parallel.zero.arguments import describe_compute
from lightning_parallel.zero.engine import announce_compilation, deepspeed_environment, initialize_engine


def initialize_zero(strategy: CheckpointingStrategy, trainer: Trainer, pipelined: bool) -> None:
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
        strategy.lightning_module, strategy.optimizers[0], [c.scheduler for c in strategy.lr_scheduler_configs],
        zero, strategy.device_mesh, strategy.precision_plugin.precision, trainer.gradient_clip_val,
        strategy._process_group_backend, strategy._timeout,
    )  # fmt: skip
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
