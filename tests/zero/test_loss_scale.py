"""16-mixed's loss scale under DeepSpeed's engine (lightning_parallel/zero/loss_scale.py, zero/precision.py).

No process group: the dynamic rule against torch's own kernel (``torch._amp_update_scale_``, what
``torch.amp.GradScaler.update`` runs), and ``ZeroPrecision`` driving an engine whose optimizer
reports an overflow: the step is skipped by the engine, the scale backs off, and the next backward
hands the engine the smaller scale. The parity of 16-mixed under ZeRO with a one-process run is in
tests/distributed/test_parity_zero.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_parallel.zero.loss_scale import ZeroLossScale
from lightning_parallel.zero.precision import ZeroPrecision


def _torch_rule(overflows: list[bool], **settings: float) -> list[float]:
    """The scale after each step by torch's own update kernel (GradScaler's), for the same overflows."""
    scale = torch.tensor([settings.get("init_scale", 2.0**16)])
    tracker = torch.zeros(1, dtype=torch.int32)
    scales = []
    for overflow in overflows:
        found_inf = torch.tensor([1.0 if overflow else 0.0])
        torch._amp_update_scale_(
            scale, tracker, found_inf, settings.get("growth_factor", 2.0), settings.get("backoff_factor", 0.5),
            int(settings.get("growth_interval", 2000)),
        )  # fmt: skip
        scales.append(float(scale))
    return scales


@pytest.mark.parametrize("growth_interval", [1, 3, 2000])
def test_the_dynamic_rule_is_grad_scalers(growth_interval: int) -> None:
    overflows = [True, False, False, False, True, True, False, False, False, False, False, False, True]
    ours = ZeroLossScale(init_scale=2.0**10, growth_interval=growth_interval)
    scales = []
    for overflow in overflows:
        ours.update(overflow=overflow)
        scales.append(ours.get_scale())
    assert scales == _torch_rule(overflows, init_scale=2.0**10, growth_interval=growth_interval)
    assert ours.skipped_steps == sum(overflows)
    # The scale went somewhere: a rule that never moved would pass the first comparison only by luck.
    assert len(set(scales)) > 2


class _Optimizer:
    """What ZeroPrecision and ZeroLossScale touch of DeepSpeed's ZeRO optimizer."""

    def __init__(self) -> None:
        self.torch_autocast_gradscaler = object()  # DeepSpeed's own GradScaler for float16 autocast
        self.external_loss_scale: float | None = None
        self.overflow = False
        self.ready_for_gradients = True

    def override_loss_scale(self, scale: float) -> None:
        self.external_loss_scale = scale


class _Engine:
    def __init__(self) -> None:
        self.optimizer = _Optimizer()
        self.backward_scales: list[float | None] = []
        self.steps_taken = 0

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool) -> None:
        assert scale_wrt_gas is False  # Lightning divides for accumulation, DeepSpeed must not
        self.backward_scales.append(self.optimizer.external_loss_scale)

    def step(self) -> None:
        if not self.optimizer.overflow:  # DeepSpeed's ZeRO optimizers skip a step whose gradients overflowed
            self.steps_taken += 1


def _model(engine: _Engine) -> SimpleNamespace:
    return SimpleNamespace(
        trainer=SimpleNamespace(strategy=SimpleNamespace(zero_engine=engine)), automatic_optimization=True
    )


def test_zero_precision_skips_a_step_on_overflow_and_backs_the_scale_off() -> None:
    plugin = ZeroPrecision("16-mixed", "cpu")
    engine = _Engine()
    model = _model(engine)
    plugin._after_closure = lambda model, optimizer: None  # Lightning's hooks: no trainer here
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 2.0**16
    for overflow in (False, True, False):
        plugin.backward(torch.ones(()), model, None)
        engine.optimizer.overflow = overflow
        plugin.optimizer_step(None, model, closure=lambda: torch.ones(()))
    # The engine scaled every backward by the scale of the moment; it did not use its own GradScaler.
    assert engine.backward_scales == [2.0**16, 2.0**16, 2.0**15]
    assert engine.optimizer.torch_autocast_gradscaler is None
    assert engine.steps_taken == 2 and plugin.scaler.skipped_steps == 1  # the overflowed step was skipped
    assert plugin.scaler.get_scale() == 2.0**15
    assert plugin.state_dict() == {
        "zero_loss_scale": {"scale": 2.0**15, "growth_tracker": 1, "skipped_steps": 1}
    }
    # The forward computes in float16 under autocast; inputs are not cast (autocast casts).
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16


def test_bf16_mixed_and_a_users_own_precision_section_have_no_scale_of_ours() -> None:
    """Negative controls: no loss scale where none belongs (bf16), or where DeepSpeed's own fp16 section scales."""
    assert ZeroPrecision("bf16-mixed", "cpu").scaler is None
    assert ZeroPrecision("16-mixed", "cpu", own_loss_scale=False).scaler is None
    plugin = ZeroPrecision("bf16-mixed", "cpu")
    engine = _Engine()
    plugin.backward(torch.ones(()), _model(engine), None)
    assert engine.backward_scales == [None] and engine.optimizer.torch_autocast_gradscaler is not None


def test_a_users_grad_scaler_settings_are_kept() -> None:
    """``MixedPrecision("16-mixed", ..., scaler=GradScaler(...))`` under DeepSpeed: its settings, not the defaults."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, backoff_factor=0.25)
    kept = ZeroPrecision("16-mixed", "cpu", scaler=scaler).scaler
    assert kept is not None and kept.get_scale() == 2.0**8
    assert (kept.growth_interval, kept.backoff_factor, kept.growth_factor) == (2, 0.25, 2.0)
    assert (
        ZeroPrecision("16-mixed", "cpu").scaler.get_scale() == 2.0**16
    )  # without one: GradScaler's defaults
