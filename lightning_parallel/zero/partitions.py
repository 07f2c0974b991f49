"""Where DeepSpeed's ZeRO optimizers keep the fp32 partitions, their optimizer state and the module's copy.

DeepSpeed's public per-parameter API (``deepspeed.utils.safe_{get,set}_full_*``) reads and
writes one parameter's master weight and state. What it does not cover, and what checkpoints
need, lives here: the flat fp32 partitions the base optimizer steps (its ``state`` is keyed by
them), which parameter group a parameter is in, creating the state before the first step, and
refreshing the module's own copy after the masters changed. This is the one file that knows the
attribute names of DeepSpeed's ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ZeRO-3
(``DeepSpeedZeroOptimizer_Stage3``) optimizers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "ensure_state",
    "link_states",
    "partition_of",
    "set_full",
    "flat_partitions",
    "group_of",
    "is_stage3",
    "loss_scaler_state",
    "refresh_module_copy",
    "state_keys",
    "step_count",
]


def is_stage3(optimizer: Any) -> bool:
    """ZeRO-3 keeps its masters per sub-group and partitions the module's parameters too."""
    return hasattr(optimizer, "fp32_partitioned_groups_flat")


def flat_partitions(optimizer: Any) -> list[torch.Tensor]:
    """The fp32 tensors the base optimizer steps (its ``state`` is keyed by them), one per group."""
    if is_stage3(optimizer):
        return list(optimizer.fp32_partitioned_groups_flat)
    return list(optimizer.single_partition_of_fp32_groups)


def group_of(optimizer: Any) -> dict[int, int]:
    """``id(parameter) -> index`` of its parameter group in the base optimizer."""
    if is_stage3(optimizer):
        return {
            id(p): optimizer.sub_group_to_group_id[i]
            for i, group in enumerate(optimizer.fp16_groups)
            for p in group
        }
    return {id(p): i for i, group in enumerate(optimizer.bit16_groups) for p in group}


def state_keys(optimizer: Any) -> list[str]:
    """Per-element state of the base optimizer (``exp_avg``, ``momentum_buffer``, ...), as every rank has it."""
    keys: set[str] = set()
    for flat in flat_partitions(optimizer):
        for key, value in optimizer.optimizer.state.get(flat, {}).items():
            if torch.is_tensor(value) and value.shape == flat.shape:
                keys.add(key)
    return sorted(keys)


def step_count(optimizer: Any) -> Any:
    """The optimizer's step count (every flat partition steps together): a tensor (torch) or an int (CPU Adam)."""
    for flat in flat_partitions(optimizer):
        step = optimizer.optimizer.state.get(flat, {}).get("step")
        if step is not None:
            return step.clone() if torch.is_tensor(step) else step
    return None


def loss_scaler_state(optimizer: Any) -> dict[str, Any]:
    """fp16's dynamic loss scale and its counters (plain numbers), so a resumed run neither restarts at
    the initial scale nor skips steps the uninterrupted run took."""
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None:
        return {}
    return {
        k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float)) and not k.startswith("_")
    }


def refresh_module_copy(module: nn.Module, optimizer: Any, values: dict[int, torch.Tensor]) -> None:
    """After the masters changed: the module's copy, as DeepSpeed's step refreshes it. Stages 1/2: every
    rank holds whole weights (views into ZeRO's flat buffers). Stage 3: each rank its partition of the
    flat low-precision buffer, the mirror of its fp32 partition. Without an engine (``validate``,
    ``test``), the module's plain parameters."""
    if optimizer is None or not is_stage3(optimizer):
        for param in module.parameters():
            if id(param) in values:
                param.data.copy_(values[id(param)].to(param.dtype))
        return
    for low, master in zip(
        optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat, strict=True
    ):
        if low is None:
            raise NotImplementedError(
                "Resuming a ZeRO-3 checkpoint with `offload='nvme'` is not supported yet (the parameters are"
                " swapped out); resume with `offload='cpu'` or without offload, or start from its weights with"
                " `init_weights=` (export them with `python -m lightning_parallel export`)."
            )
        low.data.copy_(master.data)


def _step_as(base: torch.optim.Optimizer, step: Any) -> Any:
    """A step count in the type ``base`` keeps: an int for DeepSpeed's CPU Adam, a float32 tensor for torch's
    optimizers (so a checkpoint moves between offloaded and on-device runs)."""
    if type(base).__name__ == "DeepSpeedCPUAdam":
        return int(step)
    return step.clone() if torch.is_tensor(step) else torch.tensor(float(step), dtype=torch.float32)


def ensure_state(optimizer: Any, keys: list[str], step: Any) -> None:
    """Create the base optimizer's per-partition state before its first step (torch optimizers create it
    lazily), so that DeepSpeed's setters have a place to write, and link ZeRO-1/2's per-parameter views."""
    state = optimizer.optimizer.state
    for flat in flat_partitions(optimizer):
        entry = state[flat]
        for key in keys:
            if key not in entry:
                entry[key] = torch.zeros_like(flat)
        if step is not None:
            entry["step"] = _step_as(optimizer.optimizer, step)
    if keys:
        link_states(optimizer)


def link_states(optimizer: Any) -> None:
    """ZeRO-1/2's per-parameter views of the optimizer state (what DeepSpeed's getters and setters read), made
    for every param group that has its state.

    DeepSpeed makes them once, right after the step of the first param group (it steps the groups one by
    one), when the later groups have no state yet: under several groups (the GPT recipe's decayed and
    undecayed weights) the later groups' views stayed empty, and a checkpoint failed reading them
    ("exp_avg not found in optimizer state fragment"). ZeRO-3 reads its partitions directly."""
    if is_stage3(optimizer):
        return
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    state = optimizer.optimizer.state
    for params, flat in zip(optimizer.bit16_groups, optimizer.single_partition_of_fp32_groups, strict=True):
        if flat in state:  # a group not stepped yet has nothing to view (``state`` makes entries on lookup)
            lazy_init_hp_params_optimizer_state(params, flat, state)
    optimizer._hp_optimizer_states_linked = True


def partition_of(value: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s ``size`` elements of ``value`` flattened, the last rank's padded with zeros as
    ZeRO-3 pads its partitions."""
    part = value.flatten()[rank * size : (rank + 1) * size]
    return torch.cat([part, part.new_zeros(size - part.numel())]) if part.numel() < size else part


def set_full(param: nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """Write the whole fp32 master (``key=None``) or optimizer state ``key`` of ``param``: each rank keeps its part.

    ZeRO-1/2: DeepSpeed's ``safe_set_full_*``. ZeRO-3: its ``safe_set_local_*`` with this rank's partition,
    because ``safe_set_full_*`` there cuts the last rank's partition past the end of a weight whose size
    does not divide by the number of ranks (DeepSpeed 0.19: ``narrow`` of ``value``, which is unpadded).
    """
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    if not hasattr(param, "ds_id"):
        if key is None:
            safe_set_full_fp32_param(param, value)
        else:
            safe_set_full_optimizer_state(param, value, key)
        return
    if not param.requires_grad:
        return

    part = partition_of(value, dist.get_rank(param.ds_process_group), param.ds_tensor.numel())
    if key is None:
        safe_set_local_fp32_param(param, part)
    else:
        safe_set_local_optimizer_state(param, part, key)
