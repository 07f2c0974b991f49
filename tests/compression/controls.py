"""Test-only pruning variants, importable by the harness's workers (negative controls)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_parallel.compression import KnowledgeDistillation, MagnitudePruning
from lightning_parallel.compression.kd_loss import distillation_kl, shard_like
from lightning_parallel.compression.qat import QuantizationAwareTraining
from lightning_parallel.precision.layout_sum import local_values


class ShardLocalPruning(MagnitudePruning):
    """What a per-shard mask computes (``torch.nn.utils.prune`` on a shard): each rank's own threshold.

    Under tensor parallelism it must fail the parity with the one-process run, whose threshold is global.
    """

    def _prune(self, sparsity: float) -> None:
        magnitudes = [local_values(p).detach().abs().float() for p in self._params]
        flat = torch.cat([m.flatten() for m in magnitudes])
        k = max(1, round(sparsity * flat.numel()))
        self.threshold = float(flat.kthvalue(k).values)
        self._masks = [m > self.threshold for m in magnitudes]
        self.sparsity = sparsity


class DistilFromFamily(KnowledgeDistillation):
    """A teacher built in the worker: a test family's inner model from its own seed (picklable, repr-able case data)."""

    def __init__(
        self, family: str = "recipe_gpt", seed: int = 7, teacher_kwargs: dict | None = None, **kwargs: object
    ) -> None:
        from tests.models.families import build

        super().__init__(build(family, seed=seed, **(teacher_kwargs or {})).model, **kwargs)


class ShardLocalKD(DistilFromFamily):
    """The KL of each rank's vocabulary shard alone (its own log-sum-exp): what a sharded KL without the
    cross-rank normalisation computes; under loss_parallel it must fail the parity with one process."""

    def _kd_loss(self, student: Tensor, teacher: Tensor) -> Tensor:
        if not isinstance(student, DTensor):
            return super()._kd_loss(student, teacher)
        local = student.to_local()
        teacher_local = shard_like(teacher, student).to_local()
        return distillation_kl(local, teacher_local, self.temperature)


class QATOnOneProcessOnly(QuantizationAwareTraining):
    """Prepares only in a one-process run: the distributed run trains the float model (negative control)."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.world_size == 1:
            super().setup(trainer, pl_module, stage)
