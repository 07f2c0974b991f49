"""DeepSpeed's CPU Adam on FSDP2's shards: the parameters FSDP2 leaves on the accelerator get torch's Adam,
which must be the same update (checked on the CPU by running that path on CPU tensors)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lightning_parallel.zero.optimizer import offload_optimizer

HYPER = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]


def _train(step: str, adamw: bool = True) -> list[torch.Tensor]:
    from lightning_parallel.zero.sharded_cpu_adam import ShardedCPUAdam

    params = _params()
    optimizer = ShardedCPUAdam(params, adamw_mode=adamw, **HYPER)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        if step == "kernel":
            optimizer.step()
        else:  # what runs for the parameters FSDP2 keeps on the accelerator
            for group in optimizer.param_groups:
                optimizer._step_on_device(group, group["params"])
    assert all(float(optimizer.state[p]["step"]) == 3.0 for p in params)
    return [p.detach().clone() for p in params]


def test_parameters_left_on_the_device_get_the_same_update_as_the_kernel() -> None:
    kernel, on_device = _train("kernel"), _train("device")
    start = _params()
    assert all(not torch.allclose(k, s) for k, s in zip(kernel, start, strict=True))  # the steps moved them
    for k, d in zip(kernel, on_device, strict=True):
        torch.testing.assert_close(d, k, rtol=1e-5, atol=1e-6)
    # Negative control: Adam's L2 term instead of AdamW's decoupled decay is another update.
    coupled = _train("device", adamw=False)
    assert any(not torch.allclose(c, k, rtol=1e-5, atol=1e-6) for c, k in zip(coupled, kernel, strict=True))


def test_the_offloaded_optimizer_is_freed_without_the_cycle_collector() -> None:
    """The step counter the LR scheduler needs holds the optimizer weakly (no reference cycle)."""
    pytest.importorskip("deepspeed")
    optimizer = torch.optim.AdamW(_params(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    swapped = offload_optimizer(optimizer, [scheduler])
    assert hasattr(swapped.step, "_wrapped_by_lr_sched")
    dead = weakref.ref(swapped)
    gc.disable()
    try:
        del optimizer, scheduler, swapped
        assert dead() is None
    finally:
        gc.enable()
