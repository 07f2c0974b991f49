"""A callback that records what an optimizer was given, for tests that replay a defined update rule.

The rules of ``offload_update`` other than the exact one (``zero/importance_split.py``) are checked by
replaying them in one process on the very gradients the run computed: the forward and backward are the
exact path's, held to the one-process run by the parity suite; what is checked here is the update. A
reference that ran its own forward would compare the rule through the noise of two gradient computations,
which Adam scales up where a gradient is near zero.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_parallel.zero.deferred_update import HYPER_PARAMETERS


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor: every rank must call it)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone().cpu()


class GradientCapture(L.Callback):
    """Saves to ``path`` (rank 0, at the end of training): the parameters before training, each optimizer step's whole
    gradients and learning rate, and the optimizer's hyper-parameters, by the module's names."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.record: dict[str, Any] = {"steps": []}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["initial"] = {n: _whole(p) for n, p in pl_module.named_parameters()}
        group = trainer.optimizers[0].param_groups[0]
        self.record["hyper"] = {k: group[k] for k in HYPER_PARAMETERS}

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.record["steps"].append(
            {n: _whole(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}
        )
        self.record.setdefault("lrs", []).append(
            optimizer.param_groups[0]["lr"]
        )  # this step's (a scheduler's)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            torch.save(self.record, self.path)
