"""Precision for sharded models: Lightning's plugins with global-norm clipping and agreed loss scaling.

- :func:`global_grad_norm`, :func:`clip_grad_norm_`, :func:`clip_grad_value_`: gradient maths
  over plain tensors and DTensors on any meshes, plus pipeline stages (torch only).
- :class:`DistributedGradScaler`: fp16 loss scaling whose skip decision is the same on every rank.
- :class:`HybridPrecision` and subclasses, :func:`build_precision_plugin`,
  :func:`convert_precision_plugin`: what ``HybridParallelStrategy`` installs as its plugin.
"""

from lightning_parallel.precision.grad_norm import clip_grad_norm_, clip_grad_value_, global_grad_norm
from lightning_parallel.precision.loss_scaler import DistributedGradScaler
from lightning_parallel.precision.plugin import (
    SUPPORTED_PRECISIONS,
    HybridHalfPrecision,
    HybridMixedPrecision,
    HybridPrecision,
    build_precision_plugin,
    convert_precision_plugin,
)

__all__ = [
    "SUPPORTED_PRECISIONS",
    "DistributedGradScaler",
    "HybridHalfPrecision",
    "HybridMixedPrecision",
    "HybridPrecision",
    "build_precision_plugin",
    "clip_grad_norm_",
    "clip_grad_value_",
    "convert_precision_plugin",
    "global_grad_norm",
]
