"""``ActivationMemoryMonitor``: the activation bytes each training step holds for its backward pass.

Add it to the Trainer with ``HybridParallelStrategy``; after ``fit`` it holds one
:class:`~lightning_parallel.memory.counting.ActivationBytes` per step (this process's counts)
and, with ``log=True``, logs ``activation_bytes/on_device`` and ``activation_bytes/total``::

    monitor = ActivationMemoryMonitor()
    trainer = L.Trainer(strategy=HybridParallelStrategy(activation_checkpointing="full"), callbacks=[monitor])
    trainer.fit(model, data)
    print(monitor.steps[-1].on_device)

Counting is exact (see :mod:`.counting`) and costs a dictionary lookup per saved tensor.
Under pipeline parallelism a step's count is the sum over its micro-batches.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_parallel.memory.counting import ActivationBytes, SavedTensorCounter

__all__ = ["ActivationMemoryMonitor"]


class ActivationMemoryMonitor(Callback):
    """Counts, for every training step, the activation bytes held for backward (see module docstring)."""

    def __init__(self, *, log: bool = False) -> None:
        self.log = log
        self.steps: list[ActivationBytes] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if not hasattr(strategy, "activation_counter"):
            raise ValueError(
                f"ActivationMemoryMonitor needs HybridParallelStrategy; the Trainer's strategy is"
                f" {type(strategy).__name__}."
            )
        strategy.activation_counter = SavedTensorCounter.for_module(pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        counter = trainer.strategy.activation_counter
        if counter is None:
            return
        counter.bytes.alive_after_step = counter.alive_now()
        self.steps.append(counter.bytes)
        if self.log:
            pl_module.log("activation_bytes/on_device", float(counter.bytes.on_device), on_step=True)
            pl_module.log("activation_bytes/total", float(counter.bytes.total), on_step=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.activation_counter = None
