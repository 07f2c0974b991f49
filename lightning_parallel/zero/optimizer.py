"""The user's optimizer, as ZeRO offloading wants it.

With optimizer states offloaded, the update runs on the CPU: a torch Adam/AdamW there is several
times slower than DeepSpeed's vectorised CPU Adam, so those two are rebuilt as ``DeepSpeedCPUAdam``
with the same parameter groups and hyper-parameters (``adamw_mode`` keeps AdamW's decoupled weight
decay apart from Adam's L2 term). Any other optimizer stays the user's and runs on the CPU. The LR
schedulers of ``configure_optimizers`` are re-pointed at the new optimizer, so they keep stepping
as in Lightning.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.zero.arguments import ZeroArguments
from lightning_parallel.zero.fsdp import KEPT_ON_DEVICE


def _adam_mode(optimizer: torch.optim.Optimizer) -> bool | None:
    """``True`` for AdamW, ``False`` for Adam, ``None`` for anything else."""
    if type(optimizer) is torch.optim.AdamW:
        return True
    if type(optimizer) is torch.optim.Adam:
        # torch >= 2.6: Adam(decoupled_weight_decay=True) is AdamW.
        return bool(optimizer.defaults.get("decoupled_weight_decay", False))
    return None


def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    schedulers: Iterable[Any] = (),
    *,
    sharded: bool = False,
    nvme: tuple[str, int] | None = None,
) -> torch.optim.Optimizer:
    """Return DeepSpeed's CPU Adam for a torch Adam/AdamW (same groups and hyper-parameters), else ``optimizer``.

    ``sharded``: the parameters are FSDP2's DTensor shards on the CPU (``zero/sharded_cpu_adam.py``);
    otherwise DeepSpeed's engine hands the kernel its own flat fp32 partitions. ``nvme``: (folder, rank)
    for the states of sharded parameters in files (``zero/sharded_nvme_adam.py``).
    """
    adamw_mode = _adam_mode(optimizer)
    if adamw_mode is None and nvme is not None:
        raise ValueError(
            f"`offload='nvme'` with {type(optimizer).__name__}: on this layout the optimizer states swapped to"
            " NVMe are Adam's (DeepSpeed's CPU Adam on FSDP2's CPU shards), and another optimizer's states have"
            " no swapper. Return torch.optim.Adam or AdamW from `configure_optimizers`, or use `offload='cpu'`."
        )
    if adamw_mode is None:
        return optimizer
    for option in ("amsgrad", "maximize"):
        if any(group.get(option, False) for group in optimizer.param_groups):
            raise ValueError(
                f"`{type(optimizer).__name__}({option}=True)` with `offload='cpu'`: DeepSpeed's CPU Adam has no"
                f" {option}. Drop {option}, or turn offloading off."
            )
    extra: dict[str, Any] = {}
    # lazy: all three import deepspeed, an optional dependency (zero/sharded_cpu_adam.py)
    if sharded and nvme is not None:
        from lightning_parallel.zero.sharded_nvme_adam import ShardedNVMeAdam as CPUAdam

        extra = {"nvme_path": nvme[0], "rank": nvme[1]}
    elif sharded:
        from lightning_parallel.zero.sharded_cpu_adam import ShardedCPUAdam as CPUAdam
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam as CPUAdam

    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
        hyper["lr"] = float(hyper["lr"])
        groups.append(hyper)
    defaults = optimizer.defaults
    replacement = CPUAdam(
        groups,
        lr=float(defaults["lr"]),
        betas=tuple(defaults["betas"]),
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        adamw_mode=adamw_mode,
        **extra,
    )
    for scheduler in schedulers:
        _repoint(scheduler, optimizer, replacement)
    return replacement


def _repoint(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    if getattr(scheduler, "optimizer", None) is not old:
        return
    scheduler.optimizer = new
    # The scheduler counted calls of the old optimizer's ``step``; the new one is stepped by ZeRO or Lightning.
    vars(new)["_opt_called"] = True  # what the scheduler's step wrapper sets on a stepped optimizer
    _count_steps(new)


def _count_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as a scheduler marks the optimizer it is built on (torch's LR schedulers wrap
    ``step`` at construction, and warn "optimizer.step() has been overridden" at their first step when the
    wrapper is missing, as it is on an optimizer that replaced the one they were built on)."""
    bound = optimizer.step
    if hasattr(bound, "_wrapped_by_lr_sched") or not isinstance(bound, types.MethodType):
        return  # marked already, or replaced by someone else: left alone
    # The function, not the bound method, and a weak reference: no cycle, the optimizer dies as before.
    function, owner = bound.__func__, weakref.ref(optimizer)

    @functools.wraps(function)
    def counted(*args: Any, **kwargs: Any) -> Any:
        stepped = owner()
        assert stepped is not None  # its own attribute: called through it
        vars(stepped)["_opt_called"] = True
        return function(stepped, *args, **kwargs)

    vars(counted)["_wrapped_by_lr_sched"] = True  # the mark torch's schedulers look for
    optimizer.step = counted  # type: ignore[method-assign]


def offload_sharded_optimizers(
    optimizers: list[Any], scheduler_configs: list[Any], zero: ZeroArguments, rank: int
) -> list[Any]:
    """FSDP2 with ``offload``: Adam/AdamW become DeepSpeed's CPU Adam on the CPU shards (the LR schedulers
    of Lightning's ``scheduler_configs`` re-pointed), their states in files of ``offload_path`` with
    ``"nvme"``; other optimizers stay (refused with ``"nvme"``)."""
    schedulers = [config.scheduler for config in scheduler_configs]
    nvme = (zero.offload_path, rank) if zero.offload == "nvme" and zero.offload_path is not None else None
    if zero.offload_ratio < 1:
        rank_zero_info(partial_offload_line(optimizers, zero))
    return [offload_optimizer(o, schedulers, sharded=True, nvme=nvme) for o in optimizers]


def partial_offload_line(optimizers: list[Any], zero: ZeroArguments) -> str:
    """What ``offload_ratio`` chose on this rank: the fraction of the optimizer's elements offloaded."""
    params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    kept = sum(p.numel() for p in params if getattr(p, KEPT_ON_DEVICE, False))
    total = sum(p.numel() for p in params) or 1
    return (
        f"ZeRO partial offload (`offload_ratio={zero.offload_ratio}`): {1 - kept / total:.0%} of the parameters"
        f" have their optimizer states and step offloaded to {zero.offload} (whole FSDP2 units, the nearest to the"
        " ratio), the rest stay on the device with torch's Adam."
    )
