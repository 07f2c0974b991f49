"""The planner's host bytes of the deferred offload updates against what a run's update objects hold.

``offload_update="delayed"`` and an ``ImportanceSplit`` keep, beside FSDP2's offloaded shards and states, what their
worker reads and what it computes until the next step installs it (``planner/host_updates.py``). A one-process
FSDP2-offload run of the GPT recipe records, after each optimizer step, the bytes of the tensors the update holds:
the gradients handed to its worker (its submitted task's arguments), the computed copies or rows it returns, and the
importance split's pending sums; the largest over the steps is the planner's figure. Negative control: the exact
update's layout predicts none of it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_parallel import ImportanceSplit
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.memory import rank_memory

pytest.importorskip("deepspeed")

STEPS = 4
SPLIT = ImportanceSplit(top_rows=0.25, update_interval=2)


def _module() -> L.LightningModule:
    from recipes.gpt.module import GPTLightningModule

    class AdamW(GPTLightningModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    return AdamW(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
        return [t for k, v in vars(value).items() if k not in ("param", "hyper") for t in _tensors(v)]
    return []


class _HeldBytes(L.Callback):
    """After each optimizer step: the bytes of what the deferred update's worker was given and returned, and of the
    split's pending sums (tensors counted once, parameters themselves never)."""

    def __init__(self) -> None:
        self.peak = 0
        self.handed: list[Any] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        update = vars(trainer.optimizers[0])["deferred_update"]
        submit = update._pool.submit

        def recording(fn: Any, work: Any, **kwargs: Any) -> Any:
            self.handed = [(hyper_param_grad[-1] if isinstance(hyper_param_grad, tuple) and len(hyper_param_grad) == 3
                            else hyper_param_grad.grad) for hyper_param_grad in work]  # fmt: skip
            return submit(fn, work, **kwargs)

        update._pool.submit = recording

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        update = vars(trainer.optimizers[0])["deferred_update"]
        returned = update._in_flight.result() if update._in_flight is not None else []
        held = [*self.handed, *_tensors(returned)]
        held += [t for rows in getattr(update, "_rows", {}).values() for t in (rows.chosen, rows.others, rows.pending)
                 if t is not None]  # fmt: skip
        unique = {
            id(t): t for t in held if not isinstance(t, torch.nn.Parameter)
        }  # the parameters themselves
        self.peak = max(self.peak, sum(t.numel() * t.element_size() for t in unique.values()))


def _measured(update: Any) -> int:
    from lightning_parallel import HybridParallelStrategy

    tokens = torch.randint(0, 64, (STEPS * 2, 17), generator=torch.Generator().manual_seed(1))
    batches = [
        (tokens[i : i + 2, :-1].contiguous(), tokens[i : i + 2, 1:].contiguous())
        for i in range(0, STEPS * 2, 2)
    ]
    held = _HeldBytes()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False, callbacks=[held],
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=HybridParallelStrategy(zero_stage=2, offload="cpu", offload_update=update),
    )  # fmt: skip
    trainer.fit(_module(), torch.utils.data.DataLoader(batches, batch_size=None))
    return held.peak


def _predicted(update: Any) -> int:
    layout = Layout(
        zero_stage=2, offload="cpu", offload_update=update, micro_batch_size=2, sequence_length=16
    )
    (rank,) = rank_memory(_module(), layout)
    return rank.update_host


@pytest.mark.timeout(300)
@pytest.mark.parametrize("update", ["delayed", SPLIT], ids=["delayed", "importance_split"])
def test_the_planner_counts_what_a_deferred_update_holds_on_the_host(update: Any) -> None:
    measured = _measured(update)
    assert measured > 0  # the update engaged and held something
    assert _predicted(update) == measured
    assert _predicted("exact") == 0  # negative control: the exact update's layout predicts none of it
