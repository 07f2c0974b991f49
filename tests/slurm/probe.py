"""A callback the SLURM tests add to the recipe's command line: it reports what the test checks.

The job's output file is all the test can read (no ``sacct`` database on the local cluster), so
rank 0 prints one line per optimizer step with the loss in full precision, and one line when
training starts (at which step: 0, or the step of the checkpoint a requeued job resumed). With
``pace_s`` every rank sleeps that long after each step of the job's first run: the test sends
the requeue signal after seeing step ``k`` and the job must still be running when it lands.
The sleep changes no numbers; the requeued run does not sleep.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class StepProbe(Callback):
    """Print ``PROBE start step=<n> restart=<r>`` and ``PROBE step=<n> loss=<float>`` on rank 0, and at the
    end the CPU seconds this process used (imports included): on a busy machine the wall time says
    little about what the test costs on a quiet one."""

    def __init__(self, pace_s: float = 0.0) -> None:
        self.pace_s = pace_s
        self._restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            print(f"PROBE start step={trainer.global_step} restart={self._restart}", flush=True)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:
            loss = float(outputs["loss"])
            print(f"PROBE step={trainer.global_step} loss={loss!r} restart={self._restart}", flush=True)
        if self.pace_s and self._restart == 0:
            time.sleep(self.pace_s)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            print(f"PROBE cpu_s={usage.ru_utime + usage.ru_stime:.1f} restart={self._restart}", flush=True)
