"""Precision under ZeRO: DeepSpeed owns the loss scale, the fp32 master weights and clipping.

Lightning's ``DeepSpeedPrecision`` already sends backward and the optimizer step to the engine;
this subclass tells the engine that Lightning has divided the loss for accumulation already
(``scale_wrt_gas=False``: Lightning, not DeepSpeed, counts accumulated batches here) and finds
the engine on the strategy, which also drives it when the pipeline schedule ran backward.

``"bf16-mixed"`` and ``"16-mixed"`` mean what they mean everywhere else in Lightning's plain
strategies: fp32 parameters, gradients and reductions, the forward under ``torch.autocast``.
DeepSpeed's own ``bf16`` section (which Lightning's ``DeepSpeedStrategy`` picks for it) casts the
whole module to bf16 instead, the forward of ``"bf16-true"`` with fp32 master weights: measured
against the one-process bf16-mixed run, losses 5e-3 off before the first step. So the engine is an
fp32 ZeRO engine whose ``torch_autocast`` section autocasts inside ``engine.forward`` (without it the
engine switches off this plugin's autocast on a GPU: ``zero/arguments.py``), and this plugin
autocasts whatever runs outside the engine (pipeline stages). ``"16-mixed"``'s loss scale is this
plugin's (``zero/loss_scale.py`` says why), handed to the engine before each backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from typing_extensions import override

from lightning_parallel.precision.grouped_mm_autocast import register_grouped_mm_autocast
from lightning_parallel.zero.loss_scale import ZeroLossScale

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ZeroPrecision(DeepSpeedPrecision):
    """``DeepSpeedPrecision`` for ``HybridParallelStrategy(zero_stage=...)``; ``device_type`` for autocast."""

    def __init__(
        self,
        precision: Any,
        device_type: str = "cpu",
        *,
        own_loss_scale: bool = True,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__(precision)
        self.device_type = device_type
        if self.precision in AUTOCAST:
            register_grouped_mm_autocast()  # the experts of Hugging Face's MoE models would stay fp32
        # ``deepspeed_config`` precision sections of the user's own replace ours: then DeepSpeed scales.
        # A user's ``GradScaler`` (``MixedPrecision("16-mixed", ..., scaler=...)``) gives its settings and scale.
        self.scaler: ZeroLossScale | None = None
        if self.precision == "16-mixed" and own_loss_scale:
            self.scaler = ZeroLossScale() if scaler is None else ZeroLossScale.from_scaler(scaler)

    @override
    def forward_context(self) -> Any:
        if self.precision in AUTOCAST:
            return torch.autocast(self.device_type, dtype=AUTOCAST[self.precision])
        return super().forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return data if self.precision in AUTOCAST else super().convert_input(data)  # autocast casts

    @staticmethod
    def _engine(model: Any) -> Any:
        return model.trainer.strategy.zero_engine

    @override
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        engine = self._engine(model)
        if self.scaler is not None:
            self.scaler.hand_to(engine.optimizer)
        engine.backward(tensor, scale_wrt_gas=False)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and closure_result is None:
            raise ValueError(
                "`training_step` returned None (skip this batch) under ZeRO: every rank must take part in the"
                " gradient reduction. Return a loss (multiply it by 0 to skip its effect)."
            )
        engine = self._engine(model)
        prepare_reduction(engine.optimizer)
        if self.scaler is not None:
            self.scaler.hand_to(engine.optimizer)  # pipeline stages scaled their losses by the same scale
        result = engine.step(**kwargs)
        if self.scaler is not None:
            self.scaler.update(overflow=bool(getattr(engine.optimizer, "overflow", False)))
        return result

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"zero_loss_scale": self.scaler.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "zero_loss_scale" in state_dict:
            self.scaler.load_state_dict(state_dict["zero_loss_scale"])


def prepare_reduction(optimizer: Any) -> None:
    """What DeepSpeed's per-parameter gradient hooks do before its stage-1 reduction, when none of them ran.

    Its ZeRO-1 optimizer allocates its reduction buckets (and, accumulating in another dtype, moves each
    gradient into ``grad_accum``) in post-accumulate-grad hooks. The zero-bubble schedules compute the
    weight gradients with ``torch.autograd.grad`` and assign them (torch's ``stage_backward_weight``), so
    those hooks never fire: without this the step's reduction indexed an empty bucket list (measured).
    """
    if getattr(optimizer, "ready_for_gradients", True) or getattr(optimizer, "partition_gradients", True):
        return  # a hook ran this step (or stage 2: gradients already reduced in backward)
    optimizer.setup_buckets()
    if optimizer.use_grad_accum_attribute:
        optimizer.fill_grad_accum_attribute()
