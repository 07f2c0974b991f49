"""Throughput reporting for the GPT recipe: tokens per second on the progress bar and in the logs.

Two tools, used together in the configs:

- :class:`TokensPerSecond`: global training tokens/s, shown on the progress bar as ``tok/s``
  and logged. It counts data-parallel replicas, not ranks (see its docstring).
- Lightning's ``ThroughputMonitor``, fed by :func:`sequences_in_batch` and
  :func:`tokens_in_batch`: per-device ``samples_per_sec`` / ``items_per_sec`` (items are
  tokens here), plus MFU when the module defines ``flops_per_batch``. Its global numbers
  multiply by the world size, so they overcount under tensor or pipeline parallelism; read
  its ``device/...`` metrics, or ``tok/s``, in that case.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


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


class TokensPerSecond(Callback):
    """Log global training tokens per second as ``tok/s``, on the progress bar and to the logger.

    Global tokens per step = tokens in the local batch x data-parallel replicas. It is not
    local tokens x world size: under tensor (or sequence, or pipeline) parallelism, several
    ranks work on the *same* batch, so multiplying by the world size would count that batch
    once per model-parallel rank. The replica count comes from
    :func:`data_parallel_replicas`, i.e. from the sampler settings the strategy chose.

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
        self._history: deque[tuple[int, float]] = deque(maxlen=window)  # (global tokens, seconds)

    @staticmethod
    def _sync(trainer: L.Trainer) -> None:
        """Wait for queued GPU work, or the clock stops before the step has really run."""
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._history.clear()

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
        self._history.append((tokens_in_batch(batch) * data_parallel_replicas(trainer), seconds))
        tokens = sum(n for n, _ in self._history)
        elapsed = sum(s for _, s in self._history)
        if elapsed > 0:
            pl_module.log("tok/s", tokens / elapsed, prog_bar=True, on_step=True, on_epoch=False)
