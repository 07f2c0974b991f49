"""At setup, the planner's prediction for the job that starts: memory per rank, from the same model as
``python -m lightning_parallel plan`` (``planner/``), read from the unchanged module and the first batch.

Printed on rank 0 before the module is sharded, from the first batch the strategy reads to discover the
pipeline or verify the plan (a layout without either reads none, and prints none). A prediction is advice: a model the planner cannot
read (no block stack, say) or a batch without token windows is skipped with a one-line note, never an
error, since the strategy's own checks have already accepted the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_parallel.planner.layout import PRECISIONS, Layout
from lightning_parallel.planner.memory import rank_memory
from lightning_parallel.planner.report import memory_lines
from lightning_parallel.strategy.sampling import sample_step

__all__ = ["job_layout", "log_predicted_memory", "predicting_sample"]


def _tokens_shape(batch: Any) -> tuple[int, int] | None:
    """(sequences, tokens per sequence) of the first 2-D integer tensor of the batch."""
    if isinstance(batch, torch.Tensor):
        return (
            (batch.shape[0], batch.shape[1]) if batch.dim() == 2 and not batch.is_floating_point() else None
        )
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _tokens_shape(value)
        if found is not None:
            return found
    return None


def job_layout(strategy: Any, precision: str, batch_shape: tuple[int, int]) -> Layout:
    """The planner's :class:`Layout` of a set-up strategy and its first batch (one rank's DataLoader batch)."""
    config, dims = strategy.config, strategy.dims
    pipeline = config.pipeline
    checkpointing = config.memory.checkpointing
    micro_batches = pipeline.micro_batches if pipeline else 1
    return Layout(
        tensor_parallel=dims.tensor_parallel,
        sequence_parallel=config.tensor.sequence_parallel and dims.tensor_parallel > 1,
        pipeline_parallel=dims.pipeline_parallel,
        pipeline_schedule=pipeline.spec.name if pipeline else "1f1b",
        pipeline_virtual_stages=pipeline.virtual_stages if pipeline else 1,
        micro_batches=micro_batches,
        data_parallel=dims.data_parallel,
        expert_parallel=dims.expert_parallel,
        zero_stage=config.zero.stage,
        offload=config.zero.offload,
        zero_engine=config.zero.engine,
        offload_update=config.zero.update,
        zero_gather_dtype=config.zero.gather_dtype,
        activation_checkpointing=checkpointing.mode if checkpointing else None,
        activation_checkpointing_policy="ops_alternate_matmuls"
        if checkpointing and checkpointing.alternate_matmuls
        else "ops",
        precision=precision if precision in PRECISIONS else "32-true",
        micro_batch_size=max(batch_shape[0] // micro_batches, 1),
        sequence_length=batch_shape[1],
    )


def predicting_sample(
    trainer: Trainer, strategy: Any, module: nn.Module, *, training: bool
) -> Callable[[], Any]:
    """The recipe's sample maker (``sampling.sample_step``), logging the prediction from the batch it reads.

    The batch is the one the strategy reads anyway, on every rank: reading another (on rank 0 alone) would
    advance that rank's data and random state, and the ranks would no longer see the same batches.
    """

    def sample() -> Any:
        step = sample_step(trainer, strategy)
        if step is not None and training and strategy.global_rank == 0:
            log_predicted_memory(module, strategy, trainer, step.batch)
        return step

    return sample


def log_predicted_memory(module: nn.Module, strategy: Any, trainer: Trainer, batch: Any) -> None:
    """Print the predicted memory per rank of this job (rank 0), or why there is none; warn when the job is not
    the one ``HybridParallelStrategy.auto`` planned (other devices or precision)."""
    if strategy.dims.context_parallel > 1:
        rank_zero_info("predicted memory: skipped, the planner does not model context parallelism")
        return
    shape = _tokens_shape(batch)
    if shape is None:
        rank_zero_info("predicted memory: skipped, the first batch holds no (batch, tokens) tensor")
        return
    try:
        layout = job_layout(strategy, str(trainer.precision), shape)
        ranks = rank_memory(module, layout)
    except Exception as error:  # advice only: the strategy's own checks accepted this layout
        rank_zero_info(f"predicted memory: skipped ({type(error).__name__}: {error})")
        return
    lines = memory_lines(layout, ranks)
    note = " (optimizer states as AdamW's: configure_optimizers has not run yet)"
    rank_zero_info("\n".join([f"predicted {lines[0]}{note}", *lines[1:]]))
    planned = getattr(strategy, "planned_layout", None)
    if planned is not None:
        differs = {
            k: (getattr(planned, k), getattr(layout, k))
            for k in ("precision", "data_parallel", "micro_batch_size", "sequence_length")
            if getattr(planned, k) != getattr(layout, k)
        }
        if differs:
            rank_zero_warn(
                "HybridParallelStrategy.auto planned another job than this one (planned, actual): "
                + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in differs.items())
                + ". Pass the Trainer's precision and devices, and the DataLoader's batch, to auto()."
            )
