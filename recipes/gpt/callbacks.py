"""Throughput reporting for the recipes: tokens/s, TFLOP/s and MFU on the progress bar and in the logs.

Tools, used together in the configs:

- :class:`TokensPerSecond`: global training tokens/s (``tok/s``), and this device's model TFLOP/s
  (``TFLOP/s``) and MFU (``MFU``, where the device's peak is known), on the progress bar and
  logged. It counts data-parallel replicas, not ranks (see its docstring).
- :class:`StepFlops`: the recipes' modules count their model FLOPs from their shapes
  (``lightning_parallel.plans.flops``) and define ``flops_per_batch``, this device's share.
- Lightning's ``ThroughputMonitor``, fed by :func:`sequences_in_batch` and
  :func:`tokens_in_batch`: per-device ``samples_per_sec`` / ``items_per_sec`` (items are
  tokens here), ``device/flops_per_sec`` and ``device/mfu`` (from ``flops_per_batch``, on the
  GPUs Lightning knows). Its global numbers multiply by the world size, so they overcount under
  tensor or pipeline parallelism; read its ``device/...`` metrics, or ``tok/s``, in that case.
- :class:`StepLimitedProgressBar`: Lightning's rich bar, whose epoch field reads ``Epoch 0``
  instead of ``Epoch 0/-2`` when the run is limited by steps.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelSummary, RichModelSummary, RichProgressBar
from torch import nn

from lightning_parallel.plans.flops import forward_flops_per_token, peak_flops


def sequences_in_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """``batch_size_fn`` for ``ThroughputMonitor``: sequences in an ``(x, y)`` batch."""
    return batch[0].size(0)


def tokens_in_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """``length_fn`` for ``ThroughputMonitor``: input tokens in an ``(x, y)`` batch (B * T)."""
    return batch[0].numel()


def data_parallel_replicas(trainer: L.Trainer) -> int:
    """How many different batches one training step consumes across the whole job.

    This is the ``num_replicas`` the strategy hands to the ``DistributedSampler``, read
    through the generic Lightning property ``distributed_sampler_kwargs``. Strategies that
    run a single process do not define it, which means one replica.
    """
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    if not kwargs:
        return 1
    return int(kwargs.get("num_replicas", 1))


def compute_dtype(trainer: L.Trainer) -> torch.dtype:
    """The dtype the matmuls run in under the Trainer's precision (what the device's peak is quoted for)."""
    precision = str(trainer.precision)
    return (
        torch.bfloat16
        if precision.startswith("bf16")
        else torch.float16
        if precision.startswith("16")
        else torch.float32
    )


class StepFlops:
    """For a recipe's LightningModule: ``flops_per_batch``, this device's model FLOPs of one step.

    Counted once from the unparallelised model's shapes (:meth:`count_flops`, in ``__init__``): a
    batch's tokens x the FLOPs per token (forward and backward while training, forward in
    validation), shared by the ranks that work on the same batch (world size / data-parallel
    replicas: tensor and pipeline ranks), which is what Lightning's ``ThroughputMonitor`` expects
    per device.
    """

    trainer: L.Trainer
    _forward_flops_per_token: float = 0.0
    _tokens_in_batch: int = 0

    _flops_sequence_length: int = 0

    def count_flops(self, model: nn.Module, sequence_length: int) -> None:
        self._forward_flops_per_token = forward_flops_per_token(model, sequence_length)
        self._flops_sequence_length = sequence_length

    @property
    def forward_flops_per_sequence(self) -> int:
        """Model FLOPs of one forward pass over one full-length sequence (the model summary's ``Total FLOPs``)."""
        return int(self._forward_flops_per_token * self._flops_sequence_length)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._tokens_in_batch = tokens_in_batch(batch)

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._tokens_in_batch = tokens_in_batch(batch)

    @property
    def flops_per_batch(self) -> float:
        ranks_per_batch = self.trainer.world_size / data_parallel_replicas(self.trainer)
        passes = 3.0 if self.trainer.training else 1.0  # backward: two matmuls per forward matmul
        return passes * self._tokens_in_batch * self._forward_flops_per_token / ranks_per_batch


class StepLimitedProgressBar(RichProgressBar):
    """Lightning's rich progress bar; a run limited by ``max_steps`` reads ``Epoch 0`` (Lightning: ``Epoch 0/-2``)."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        if len(self.validation_description) > len(description):
            description = f"{description:{len(self.validation_description)}}"
        return description

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        # The rich bar formats every number as a float: the logger's version read "v_num: 0.000". It is in the
        # run's folder name (runs/<name>/version_<n>/) already.
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


class _SummaryWithFlops:
    """A Lightning model summary whose ``total_flops`` is the recipe's own count."""

    def __init__(self, summary: Any, total_flops: int) -> None:
        self._summary = summary
        self.total_flops = total_flops

    def __getattr__(self, name: str) -> Any:
        return getattr(self._summary, name)


class CountedFlopsSummary:
    """Mixin for Lightning's model summaries: ``Total FLOPs`` from the recipe's count, not 0.

    Lightning counts FLOPs only by running ``example_input_array`` through the model under
    ``FlopCounterMode``, which a parallelized model (pipeline stages, DTensor shards) cannot do on one
    rank; the recipes count their FLOPs from the shapes (:class:`StepFlops`) and report one forward
    pass over one full-length sequence, what Lightning's figure means for an example of one sequence.
    """

    def _summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        summary = super()._summary(trainer, pl_module)  # type: ignore[misc]
        counted = getattr(pl_module, "forward_flops_per_sequence", 0)
        return summary if summary.total_flops or not counted else _SummaryWithFlops(summary, counted)


def use_step_limited_bar(trainer: L.Trainer) -> L.Trainer:
    """Swap Lightning's default rich progress bar for :class:`StepLimitedProgressBar`, and its model summary
    for the same summary with the recipe's counted FLOPs (:class:`CountedFlopsSummary`)."""
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) is RichProgressBar:
            trainer.callbacks[index] = StepLimitedProgressBar()
        elif type(callback) in _COUNTED_SUMMARIES:  # the same depth and options, the FLOPs counted
            counted = _COUNTED_SUMMARIES[type(callback)]
            trainer.callbacks[index] = counted(callback._max_depth, **callback._summarize_kwargs)
    return trainer


class CountedModelSummary(CountedFlopsSummary, ModelSummary):
    """Lightning's ``ModelSummary`` with the recipe's FLOPs."""


class CountedRichModelSummary(CountedFlopsSummary, RichModelSummary):
    """Lightning's ``RichModelSummary`` with the recipe's FLOPs."""


_COUNTED_SUMMARIES: dict[type, type] = {
    ModelSummary: CountedModelSummary,
    RichModelSummary: CountedRichModelSummary,
}


class TokensPerSecond(Callback):
    """Log global training tokens per second as ``tok/s``, on the progress bar and to the logger.

    Global tokens per step = tokens in the local batch x data-parallel replicas. It is not
    local tokens x world size: under tensor (or sequence, or pipeline) parallelism, several
    ranks work on the *same* batch, so multiplying by the world size would count that batch
    once per model-parallel rank. The replica count comes from
    :func:`data_parallel_replicas`, i.e. from the sampler settings the strategy chose.

    ``TFLOP/s`` is this device's model FLOPs (the module's ``flops_per_batch``) per second, ``MFU``
    that over the device's dense peak in the Trainer's precision (``lightning_parallel.plans.flops.
    peak_flops``: known GPUs, or ``LP_PEAK_TFLOPS``; none on a CPU).

    The time is measured from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
    backward and optimizer step), averaged over the last ``window`` batches so that the
    progress bar is readable. Time spent waiting for data is excluded on purpose: this
    number measures the model's speed under a parallel layout; a data-loading bottleneck
    shows up as a gap to ``ThroughputMonitor``'s wall-clock numbers.

    Args:
        window: Number of recent batches averaged.
    """

    def __init__(self, window: int = 10) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"`window={window}` must be at least 1.")
        self.window = window
        self._start: float | None = None
        self._history: deque[tuple[int, float, float]] = deque(
            maxlen=window
        )  # (global tokens, device FLOPs, seconds)
        self._peak: float | None = None

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        """Wait for queued GPU work, or the clock stops before the step has really run."""
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._history.clear()
        self._peak = peak_flops(trainer.strategy.root_device, compute_dtype(trainer))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._sync(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            return
        self._sync(trainer)
        seconds = time.perf_counter() - self._start
        self._start = None
        flops = float(getattr(pl_module, "flops_per_batch", 0.0) or 0.0)
        self._history.append((tokens_in_batch(batch) * data_parallel_replicas(trainer), flops, seconds))
        elapsed = sum(s for _, _, s in self._history)
        if elapsed <= 0:
            return
        pl_module.log(
            "tok/s",
            sum(n for n, _, _ in self._history) / elapsed,
            prog_bar=True,
            on_step=True,
            on_epoch=False,
        )
        flops_per_second = sum(f for _, f, _ in self._history) / elapsed
        if flops_per_second > 0:
            pl_module.log("TFLOP/s", flops_per_second / 1e12, prog_bar=True, on_step=True, on_epoch=False)
            if self._peak:
                pl_module.log(
                    "MFU", flops_per_second / self._peak, prog_bar=True, on_step=True, on_epoch=False
                )
