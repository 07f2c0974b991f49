"""The savers through ``HybridParallelStrategy`` and the real Trainer (one CPU process).

``ActivationMemoryMonitor`` reads the strategy's count of each step; the numbers must be the
ones the library functions give without a Trainer (tests/memory/test_activation_memory.py),
and the losses those of the run without savers.
"""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest

from lightning_parallel import ActivationMemoryMonitor, HybridParallelStrategy
from tests.memory.test_activation_memory import F32, I64, B, C, T, outside_blocks_bytes
from tests.models.families import build, make_dataloader

STEPS = 3


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, i) -> None:  # type: ignore[no-untyped-def]
        self.values.append(float(outputs["loss"]))


def fit(model: L.LightningModule, **strategy_kwargs: object) -> tuple[list[float], ActivationMemoryMonitor]:
    L.seed_everything(0, verbose=False)
    monitor, losses = ActivationMemoryMonitor(), Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=HybridParallelStrategy(**strategy_kwargs),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[monitor, losses])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, make_dataloader(B, STEPS * B))
    return losses.values, monitor


@pytest.fixture(autouse=True)
def quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


def test_savers_through_the_strategy() -> None:
    runs = {
        name: fit(build("recipe_gpt"), **kwargs)
        for name, kwargs in {
            "none": {},
            "full": {"activation_checkpointing": "full"},
            "selective": {"activation_checkpointing": "selective"},
            "offload": {"activation_offload": True},
            "bf16": {"activation_compression": "bf16"},
        }.items()
    }
    baseline = runs["none"][1].steps[0].total
    for name, (losses, monitor) in runs.items():
        assert len(monitor.steps) == STEPS and len({step.total for step in monitor.steps}) == 1
        print(f"{name:10s} activation bytes on device {monitor.steps[0].on_device:7d}"
              f" ({monitor.steps[0].on_device / baseline:.1%}), losses {losses}")  # fmt: skip
        if name != "bf16":
            assert losses == runs["none"][0], name
    assert runs["full"][1].steps[0].total == outside_blocks_bytes() + 2 * B * T * C * F32
    assert runs["selective"][1].steps[0].on_device < baseline
    # all offloaded but the last block and what follows it (backward needs them first: tests/memory/
    # test_activation_memory.py counts them exactly)
    offload = runs["offload"][1].steps[0]
    assert offload.offloaded > 0 and offload.on_device + offload.offloaded == baseline
    assert offload.on_device == baseline - (baseline - outside_blocks_bytes()) // 2 - (B * T + T) * I64
    assert runs["bf16"][0][0] == runs["none"][0][0]  # the forward pass reads no compressed tensor
    assert runs["bf16"][1].steps[0].on_device < 0.51 * baseline


def test_a_second_fit_of_the_same_module_keeps_its_savers() -> None:
    model = build("recipe_gpt")
    fit(model, activation_offload=True)
    _, monitor = fit(model, activation_offload=True)  # the parallelized module is reused as it is
    assert monitor.steps[0].offloaded > 0 and monitor.steps[0].on_device < monitor.steps[0].total


def test_monitor_needs_the_hybrid_strategy() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ActivationMemoryMonitor()])  # fmt: skip
    with pytest.raises(ValueError, match="ActivationMemoryMonitor needs HybridParallelStrategy"):
        trainer.fit(build("recipe_gpt"), make_dataloader(B, B))


def test_recomputing_a_block_whose_moe_aux_loss_is_collected_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        fit(build("recipe_moe"), activation_checkpointing="full", moe_aux_loss_coef=0.01)
    message = str(info.value)
    assert (
        "`activation_checkpointing='full'` recomputes" in message
        and "record the loss a second time" in message
    )
    assert "`moe_aux_loss_coef=None`" in message
