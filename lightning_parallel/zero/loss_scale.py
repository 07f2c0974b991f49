"""The fp16 loss scale of ``"16-mixed"`` under DeepSpeed's engine, owned here and handed to DeepSpeed.

``"16-mixed"`` is the same contract under ZeRO as everywhere else in Lightning: an fp32 model, the
forward under ``torch.autocast(float16)``, the loss multiplied by a dynamic scale before backward.
DeepSpeed's engine gives that contract only halfway: with a ``torch_autocast`` section of dtype
float16 its ZeRO optimizers step through a ``torch.amp.GradScaler`` of their own, but clip the
gradients against their norm *before* unscaling them (``unscale_and_clip_grads`` divides by its
own loss scale, 1 for an fp32 engine), and when its overflow check skips a step the GradScaler is
never told, so the scale never backs off (read in DeepSpeed 0.19.8, ``stage_1_and_2.py`` and
``stage3.py``). Its documented hook for an outside scale, ``override_loss_scale``, has none of
that: the engine multiplies the loss by the scale in backward, divides it out in the same place it
clips, detects non-finite gradients over all its groups and skips the step. What is left to own is
the dynamic rule, which is ``torch.amp.GradScaler``'s: back off by half on an overflow, double after
``growth_interval`` clean steps.
"""

from __future__ import annotations

from typing import Any

import torch


class ZeroLossScale:
    """A dynamic fp16 loss scale with ``torch.amp.GradScaler``'s defaults and rule, for DeepSpeed's engine.

    Every rank decides alike: the overflow it is updated with is the engine's, which DeepSpeed reduces
    over the data- and model-parallel groups before it skips a step.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self._scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0
        self.skipped_steps = 0

    @classmethod
    def from_scaler(cls, scaler: torch.amp.GradScaler) -> ZeroLossScale:
        """The same settings and current scale as a user's ``torch.amp.GradScaler``."""
        return cls(
            init_scale=scaler.get_scale(),
            growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(),
            growth_interval=scaler.get_growth_interval(),
        )

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as backward must see it (pipeline stages run backward themselves)."""
        return loss * self._scale

    def update(self, *, overflow: bool) -> None:
        if overflow:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
            self.skipped_steps += 1
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._scale *= self.growth_factor
            self._growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def hand_to(self, zero_optimizer: Any) -> None:
        """Make DeepSpeed's ZeRO optimizer scale, unscale and clip by this scale (and not by a GradScaler of its own)."""
        zero_optimizer.torch_autocast_gradscaler = None
        if getattr(zero_optimizer, "external_loss_scale", None) != self._scale:
            zero_optimizer.override_loss_scale(self._scale)
