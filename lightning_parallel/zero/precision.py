"""Precision under ZeRO: DeepSpeed owns the loss scale, the fp32 master weights and clipping.

Lightning's ``DeepSpeedPrecision`` already sends backward and the optimizer step to the engine;
this subclass tells the engine that Lightning has divided the loss for accumulation already
(``scale_wrt_gas=False``: Lightning, not DeepSpeed, counts accumulated batches here) and finds
the engine on the strategy, which also drives it when the pipeline schedule ran backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from typing_extensions import override


class ZeroPrecision(DeepSpeedPrecision):
    """``DeepSpeedPrecision`` for ``HybridParallelStrategy(zero_stage=...)``."""

    @staticmethod
    def _engine(model: Any) -> Any:
        return model.trainer.strategy.zero_engine

    @override
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        self._engine(model).backward(tensor, scale_wrt_gas=False)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise ValueError(
                "`training_step` returned None (skip this batch) under ZeRO: every rank must take part in the"
                " gradient reduction. Return a loss (multiply it by 0 to skip its effect)."
            )
        return self._engine(model).step(**kwargs)
