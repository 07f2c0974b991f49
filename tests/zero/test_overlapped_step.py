"""The host step of FSDP2's offloaded shards during backward (``zero/overlapped_step.py``, issue 35).

Parity with the one-process run on dp2, tp2 and pp2 is in tests/distributed/test_parity_zero.py (the
engagement record counts the steps run during backward); here: the update of one shard stepped during
backward is the kernel's and the step leaves it alone afterwards (tests/zero/test_sharded_cpu_adam.py), the refusals, and a recorded timeline in
which the last block's host step runs while the first block's backward has not started.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import lightning as L
import pytest
import torch

from lightning_parallel.zero.overlapped_step import overlap_refusal
from tests.zero.test_sharded_cpu_adam import HYPER, _params

pytest.importorskip("deepspeed")


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"gradient_clip_val": 1.0}, "global norm"),
        ({"clipping_overridden": True}, "configure_gradient_clipping"),
        ({"loss_scaled": True}, "loss scale"),
        ({"reduced_per_micro_batch": True}, "micro_batch"),
    ],
)
def test_the_step_waits_for_backward_where_it_needs_the_whole_of_it(kwargs: dict, reason: str) -> None:
    from lightning_parallel.zero.sharded_cpu_adam import ShardedCPUAdam

    optimizer = ShardedCPUAdam(_params(), adamw_mode=True, **HYPER)
    plain = {
        "gradient_clip_val": None,
        "clipping_overridden": False,
        "loss_scaled": False,
        "reduced_per_micro_batch": False,
    }
    assert overlap_refusal(optimizer, **plain) is None
    assert reason in (overlap_refusal(optimizer, **{**plain, **kwargs}) or "")
    assert "not Adam" in (overlap_refusal(torch.optim.SGD(_params(), lr=0.1), **plain) or "")
    bf16 = ShardedCPUAdam(
        [torch.nn.Parameter(p.detach().bfloat16()) for p in _params()], adamw_mode=True, **HYPER
    )
    assert "torch.bfloat16 parameters" in (overlap_refusal(bf16, **plain) or "")


class _FirstBlockWaits(L.Callback):
    """The first block's backward waits (up to ``patience`` s) until every host step of the last block's shards has
    finished, and stamps when."""

    def __init__(self, patience: float) -> None:
        self.patience = patience
        self.finished = threading.Event()
        self.last_block: set[str] = set()
        self.stepped: set[str] = set()
        self.waited: list[bool] = []
        self.first_block_backward: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        host_step = trainer.strategy.host_step
        if host_step is not None:
            optimizer, step = host_step.optimizer, host_step.optimizer.step_in_backward
            self.last_block = {n for n, _ in pl_module.named_parameters() if ".h.3." in n}

            def stepped(param: torch.Tensor, grad: torch.Tensor | None = None) -> None:
                step(param, grad)
                self.stepped.add(host_step.name_of(param))
                if self.last_block <= self.stepped:
                    self.finished.set()

            optimizer.step_in_backward = stepped
        pl_module.model.transformer.h[0].register_forward_hook(self._hook_output)

    def on_train_batch_start(self, *args: Any) -> None:
        self.finished.clear()
        self.stepped.clear()

    def _hook_output(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(self._first_block_backward)

    def _first_block_backward(self, grad: torch.Tensor) -> None:
        self.waited.append(self.finished.wait(self.patience))
        self.first_block_backward = time.perf_counter()


def _fit(clip: float | None, patience: float) -> tuple[L.Trainer, _FirstBlockWaits]:
    from lightning_parallel import HybridParallelStrategy
    from recipes.gpt.module import GPTLightningModule

    class AdamW(GPTLightningModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 17))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2
    )
    waits = _FirstBlockWaits(patience)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, gradient_clip_val=clip, logger=False, callbacks=[waits],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=HybridParallelStrategy(zero_stage=2, offload="cpu", zero_engine="fsdp2"),
    )  # fmt: skip
    trainer.fit(AdamW(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32), data)
    return trainer, waits


@pytest.mark.timeout(300)
def test_the_last_blocks_host_step_runs_before_the_first_blocks_backward() -> None:
    """The recorded timeline: while the first block's backward waits, the host steps the last block's shards
    (the wait would time out if the host step came after backward, as it does under clipping below)."""
    trainer, waits = _fit(clip=None, patience=60.0)
    host_step = trainer.strategy.host_step
    assert host_step is not None and waits.waited == [True, True]
    last_block = [s for s in host_step.spans if ".h.3." in s.name]
    first_block = [s for s in host_step.spans if ".h.0." in s.name]
    assert last_block and first_block and host_step.backward_end is not None
    assert waits.first_block_backward is not None
    assert max(s.end for s in last_block) <= waits.first_block_backward < host_step.backward_end
    assert min(s.start for s in first_block) >= waits.first_block_backward  # its gradient came later
    assert host_step.stepped_in_backward == 2 * host_step.parameters  # every offloaded shard, every step


@pytest.mark.timeout(300)
def test_under_clipping_no_host_step_runs_during_backward() -> None:
    trainer, waits = _fit(clip=0.5, patience=0.5)
    assert trainer.strategy.host_step is None
    assert waits.waited == [False, False]  # nothing stepped while the first block's backward waited


class _CopyInFlight:
    """torch 2.11's gradient copy to pinned host memory on a GPU, as the hook finds it: the buffer is the gradient's
    only once the copy's event is waited for (FSDP2 waits at the end of backward; the hook reads it before)."""

    def __init__(self, buffer: torch.Tensor, value: torch.Tensor) -> None:
        self.buffer, self.value, self.synchronized = buffer, value, 0

    def synchronize(self) -> None:
        time.sleep(0.05)  # the copy lands a little later than the hook runs
        self.buffer.copy_(self.value)
        self.synchronized += 1


@pytest.mark.parametrize(
    "waits", [True, False], ids=["waits for the copy", "negative control: reads it early"]
)
def test_a_host_step_waits_for_the_gradient_copy_torch_2_11_leaves_in_flight(waits: bool) -> None:
    from types import SimpleNamespace

    from lightning_parallel.zero.overlapped_step import OverlappedHostStep
    from lightning_parallel.zero.sharded_cpu_adam import ShardedCPUAdam

    params = _params()
    gradients = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)
    ]
    expected_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW(expected_params, **HYPER)
    for param, grad in zip(expected_params, gradients, strict=True):
        param.grad = grad.clone()
    reference.step()

    optimizer = ShardedCPUAdam(params, adamw_mode=True, **HYPER)
    copies = {}
    for param, grad in zip(params, gradients, strict=True):
        param.grad = torch.zeros_like(grad)  # pinned memory the copy has not reached yet
        copies[id(param)] = SimpleNamespace(grad_offload_event=_CopyInFlight(param.grad, grad))
    step = OverlappedHostStep(
        optimizer, {f"p{i}": p for i, p in enumerate(params)}, copies if waits else None
    )
    try:
        with step.armed():
            for param in params:
                step._gradient_final(param)  # what FSDP2 calls right after it started the copy
            step.end_of_backward()
        if not waits:  # as before: the update read the gradient before the copy landed
            for copy in copies.values():
                copy.grad_offload_event.synchronize()  # FSDP2's own wait, at the end of backward
        optimizer.step()
    finally:
        step.close()
    matches = all(torch.allclose(p, e, atol=1e-6) for p, e in zip(params, expected_params, strict=True))
    assert matches is waits
    assert step.waited_for_copies == (len(params) if waits else 0)
    assert step.stepped_in_backward == len(params)
