"""DeepSpeed's CPU Adam on FSDP2's shards: the parameters FSDP2 leaves on the accelerator get torch's Adam,
which must be the same update (checked on the CPU by running that path on CPU tensors)."""

from __future__ import annotations

import gc
import threading
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
        elif step == "early":  # the first parameter stepped during backward (another thread), then the step
            worker = threading.Thread(target=optimizer.step_in_backward, args=(params[0],))
            worker.start()
            worker.join()
            optimizer.step()
        else:  # what runs for the parameters FSDP2 keeps on the accelerator
            for group in optimizer.param_groups:
                optimizer._step_on_device(group, group["params"])
    assert all(float(optimizer.state[p]["step"]) == 3.0 for p in params)  # each stepped once per step
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


def test_a_shard_stepped_during_backward_gets_the_kernels_update_once() -> None:
    """``step_in_backward`` (``zero/overlapped_step.py``): torch's fused CPU Adam on one shard, which the step
    that follows leaves alone."""
    after, early = _train("kernel"), _train("early")
    assert all(
        not torch.allclose(a, s) for a, s in zip(after, _params(), strict=True)
    )  # the steps moved them
    for a, e in zip(after, early, strict=True):
        torch.testing.assert_close(e, a, rtol=1e-5, atol=1e-6)


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


def _nvme_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [*_params(), torch.nn.Parameter(torch.randn(40, 70))]  # larger than the first buffers: they grow


def _train_steps(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, steps: range, forget: bool = False
) -> None:
    """Steps ``steps`` of a fixed gradient sequence (step k always gets the k-th gradients); ``forget``: the
    optimizer loses track of its files after each step (the negative control)."""
    generator = torch.Generator().manual_seed(1)
    for k in range(steps.stop):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        if k not in steps:
            continue
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        if forget:
            optimizer._on_disk.clear()
        optimizer.step()


def _nvme_optimizer(folder: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from lightning_parallel.zero.sharded_nvme_adam import ShardedNVMeAdam

    return ShardedNVMeAdam(params, nvme_path=folder, rank=0, adamw_mode=True, **HYPER)


def _in_memory(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    """Elements of ``param``'s optimizer states held in memory (the names stay, as empty scalars)."""
    state = optimizer.state[param]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    return sum(v.numel() for k, v in state.items() if k != "step" and v.dim() > 0)


def test_states_on_nvme_give_the_kernel_update_and_leave_host_memory(tmp_path) -> None:
    """offload='nvme' on FSDP2's shards: the same update as the states kept in memory, the states in files
    between steps (none in the optimizer's dict), and a state dict that resumes exactly."""
    pytest.importorskip("deepspeed")
    from lightning_parallel.zero.sharded_cpu_adam import ShardedCPUAdam

    params = _nvme_params()
    optimizer = _nvme_optimizer(str(tmp_path), params)
    _train_steps(params, optimizer, range(3))
    reference = _nvme_params()
    in_memory = ShardedCPUAdam(reference, adamw_mode=True, **HYPER)
    _train_steps(reference, in_memory, range(3))
    for got, want in zip(params, reference, strict=True):
        assert torch.equal(got, want)  # the same kernel on the same states, read back bit for bit
    assert all(_in_memory(optimizer, p) == 0 for p in params)  # nothing of Adam's states in memory
    numel = sum(p.numel() for p in params)
    assert optimizer.files.bytes_written >= 3 * 2 * 4 * numel  # each step wrote both states of every shard
    assert optimizer.files.bytes_read >= 2 * 2 * 4 * numel  # and read them back from the second step on
    assert optimizer.files.disk_bytes() >= 2 * 4 * numel
    # The checkpoint's view: tensors equal to the kernel's states in memory, dropped again afterwards.
    saved = optimizer.state_dict()
    for i, p in enumerate(reference):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][i][key], in_memory.state[p][key])
    assert all(_in_memory(optimizer, p) == 0 for p in params)
    # Resume: steps 3-4 from the saved state equal five uninterrupted steps.
    uninterrupted = _nvme_params()
    _train_steps(uninterrupted, _nvme_optimizer(str(tmp_path / "b"), uninterrupted), range(5))
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    again = _nvme_optimizer(str(tmp_path / "c"), resumed)
    again.load_state_dict(saved)
    _train_steps(resumed, again, range(3, 5))
    for got, want in zip(resumed, uninterrupted, strict=True):
        assert torch.equal(got, want)
    # Negative control: states that were not read back (zeros at every step) are another update.
    lost = _nvme_params()
    _train_steps(lost, _nvme_optimizer(str(tmp_path / "d"), lost), range(3), forget=True)
    assert any(not torch.equal(a, b) for a, b in zip(lost, reference, strict=True))
