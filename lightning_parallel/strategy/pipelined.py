"""The strategy's steps under pipeline parallelism: the user's step run per micro-batch by torch's schedule.

The Trainer's training step does forward *and* backward here (the schedule interleaves them over
micro-batches), so the gradients it produced are held aside and Lightning's ``backward`` only
adds them and runs its hooks around them (``HybridParallelStrategy.backward``). Evaluation is a
forward-only pipeline. The loss of each micro-batch is scaled as Lightning would scale the
whole batch's: divided by the accumulation, times the fp16 loss scale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lightning_parallel.experts import AuxLossCollector
from lightning_parallel.pipeline.microbatch import check_batch_size, check_divisible
from lightning_parallel.pipeline.runner import PipelineRunner


def loss_scale(module: LightningModule, scaler: Any, micro_batches: int) -> float | torch.Tensor:
    """How a (micro-)batch's loss is scaled before backward: MoE auxiliary gradients follow it.

    The fp16 scale stays the scaler's device tensor (``get_scale()`` reads it to the host: a sync per step).
    """
    scale = 1.0 / (module.trainer.accumulate_grad_batches * micro_batches)
    if scaler is None:
        return scale
    current = scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else None
    return scale * (current if current is not None else float(scaler.get_scale()))


def training_step(
    runner: PipelineRunner,
    module: LightningModule,
    scaler: Any,
    aux_losses: AuxLossCollector | None,
    context: Callable[[], AbstractContextManager[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    final: bool = True,
    batch_idx: int = 0,
) -> torch.Tensor:
    """Forward and backward of every micro-batch; the batch's gradients are held by the runner.

    ``final``: the batch ends an optimizer step (the data-parallel reduction runs during the stages'
    last backward); ``batch_idx``: Lightning zeroes the gradients after the step of the first batch of
    each accumulation window (``batch_idx % accumulate_grad_batches == 0``, as its loop decides).
    """
    batch, rest = args[0], args[1:]
    runner.batch_size = check_batch_size(batch, runner.batch_size)
    check_divisible(batch, runner.micro_batches)
    accumulate = module.trainer.accumulate_grad_batches

    def loss_factor(loss: torch.Tensor) -> torch.Tensor:
        loss = loss / accumulate
        return scaler.scale(loss) if scaler is not None else loss

    if aux_losses is not None:
        aux_losses.start_step(loss_scale(module, scaler, runner.micro_batches))
    step_fn = functools.partial(module.training_step, **kwargs) if kwargs else module.training_step
    first_of_window = batch_idx % accumulate == 0
    with context():
        return runner.train_step(
            step_fn, batch, rest, loss_factor, final=final, first_of_window=first_of_window
        )


def eval_step(
    runner: PipelineRunner,
    module: LightningModule,
    hook: str,
    context: Callable[[], AbstractContextManager[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``validation_step``/``test_step``/``predict_step`` as a forward-only pipeline."""
    step_fn = getattr(module, hook)
    if kwargs:
        step_fn = functools.partial(step_fn, **kwargs)
    with context():
        return runner.eval_step(step_fn, args[0], args[1:])
