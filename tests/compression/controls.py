"""Test-only pruning variants, importable by the harness's workers (negative controls)."""

from __future__ import annotations

import torch

from lightning_parallel.compression import MagnitudePruning
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
