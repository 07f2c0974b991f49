"""Precision for sharded models: Lightning's plugins with global-norm clipping and agreed loss scaling.

- :func:`global_grad_norm`, :func:`clip_grad_norm_`, :func:`clip_grad_value_`: gradient maths
  over plain tensors and DTensors on any meshes, plus pipeline stages.
- :class:`DistributedGradScaler`: fp16 loss scaling whose skip decision is the same on every rank.
- :class:`HybridPrecision` and subclasses, :func:`build_precision_plugin`,
  :func:`convert_precision_plugin`: what ``HybridParallelStrategy`` installs as its plugin.

Names are imported on first use: the gradient maths needs only torch, and importing
Lightning costs seconds in every worker process of a test or a pipeline stage.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_MODULE_OF = {
    "clip_grad_norm_": "grad_norm",
    "clip_grad_value_": "grad_norm",
    "global_grad_norm": "grad_norm",
    "DistributedGradScaler": "loss_scaler",
    "SUPPORTED_PRECISIONS": "plugin",
    "HybridHalfPrecision": "plugin",
    "HybridMixedPrecision": "plugin",
    "HybridPrecision": "plugin",
    "build_precision_plugin": "plugin",
    "convert_precision_plugin": "plugin",
}

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


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
