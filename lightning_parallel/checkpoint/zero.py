"""Checkpoints under ZeRO: the project's ordinary sharded checkpoint, in the user's layout.

DeepSpeed's own checkpoints hold flat per-rank partitions that only DeepSpeed (and only the
same number of ranks) can read. Here a ZeRO run saves what any other run of the strategy saves:
the model entry holds each weight under the user's name (a tensor-parallel weight as its
DTensor, an expert slice as its rows of the stacked tensor), the optimizer entry holds each
weight's state flattened per name (``state.<name>.exp_avg``, ``param_groups.<name>.lr``). So
resume, resharding to another layout, ``export`` and ``consolidate_checkpoint`` work the
same for every layout and every stage.

The values are DeepSpeed's fp32 master weights and states, read and written per parameter with
its public ``deepspeed.utils.safe_{get,set}_{full,local}_*`` API (stages 1-3, offloaded or not;
``zero/partitions.py``). The
getters all-reduce over ZeRO's data-parallel group: every rank walks the parameters in the same
(module) order. After loading, the module's own (low-precision, or at stage 3 partitioned) copy
is refreshed from the masters, as DeepSpeed's step does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.checkpoint.layouts import (
    contiguous_shards,
    expert_layouts,
    experts_as_dtensors,
    experts_as_local,
    restore_strided,
    saved_keys,
)
from lightning_parallel.checkpoint.row_layouts import registry, rows_as_stored, rows_as_user
from lightning_parallel.compat import distributed_checkpoint_load
from lightning_parallel.zero.partitions import (
    ensure_state,
    group_of,
    link_states,
    loss_scaler_state,
    refresh_module_copy,
    set_full,
    state_keys,
    step_count,
)
from lightning_parallel.zero.tensor_parallel import parametrized, user_name

__all__ = [
    "load_zero_checkpoint",
    "zero_model_state",
    "zero_optimizer_state",
]

# The optimizer entry's own keys for what belongs to DeepSpeed, not to one parameter.
_SCALER_KEY = "zero.loss_scaler"
_ENGINE_KEY = "zero.engine"
_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


# ---- the parameters as the user names them -----------------------------------------------------


def _to_saved(module: nn.Module, name: str) -> Any:
    """``local -> what the checkpoint holds``: the parametrization that rebuilds a tensor-parallel
    weight's DTensor from its local shard (``zero/tensor_parallel.py``), else the identity."""
    split = parametrized(name)
    if split is None:
        return None
    owner, attribute = split
    return getattr(module.get_submodule(owner).parametrizations, attribute)[0]


def _parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter, Any]]:
    """``(user name, registered parameter, to_saved)`` for every name a weight has (tied weights twice),
    in module order, which is the same on every rank of a ZeRO group."""
    for name, param in module.named_parameters(remove_duplicate=False):
        yield user_name(name), param, _to_saved(module, name)


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers (never partitioned by ZeRO), as ``state_dict`` would list them."""
    out = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                out[user_name(f"{owner_name}.{name}" if owner_name else name)] = buffer
    return out


def _local_shape(param: nn.Parameter) -> torch.Size:
    """The parameter's unpartitioned shape (at stage 3 ``param`` itself is an empty placeholder)."""
    return torch.Size(param.ds_shape) if hasattr(param, "ds_id") else param.shape


def _as_saved(value: torch.Tensor, to_saved: Any) -> Any:
    return value if to_saved is None else to_saved(value)


def _full_fp32(param: nn.Parameter) -> torch.Tensor:
    """The fp32 master of ``param`` (its tensor-parallel local shard, unpartitioned by ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param

    value = safe_get_full_fp32_param(param)
    if value is not None:
        return value.detach().float()
    # Frozen (no master weight): the module's copy, gathered at stage 3.
    if hasattr(param, "ds_id"):
        from deepspeed.zero import GatheredParameters

        with GatheredParameters([param]):
            return param.detach().float().clone()
    return param.detach().float().clone()


# ---- save -------------------------------------------------------------------------------------


def _owned_by_this_rank(module: nn.Module) -> Callable[[int], bool]:
    """Which parameters (by index in module order) this rank keeps in its part of the checkpoint.

    Every rank of a ZeRO data-parallel group receives each whole master (the getters all-reduce), but
    the copies are identical: keeping every ``dp``-th one on each rank (round robin) divides the memory
    a save holds by ``dp``, and the group's ranks together still write every weight once.
    """

    group = next(
        (
            g
            for p in module.parameters()
            if (g := getattr(p, "_dp_group", None) or getattr(p, "ds_process_group", None))
        ),
        None,
    )
    if group is None or not dist.is_initialized():
        return lambda index: True
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return lambda index: index % size == rank


def zero_model_state(module: nn.Module, ep_mesh: Any) -> dict[str, Any]:
    """The model entry of a checkpoint under ZeRO: fp32 master weights under the user's names (this rank's
    share of them, see :func:`_owned_by_this_rank`; on the CPU, so a save adds no accelerator memory).

    Collective over each ZeRO data-parallel group: call it on every rank.
    """
    owned = _owned_by_this_rank(module)
    full: dict[int, torch.Tensor | None] = {}
    state: dict[str, Any] = {}
    for name, param, to_saved in _parameters(module):
        if id(param) not in full:  # a tied weight is read (and all-reduced) once
            value = _full_fp32(param)  # on every rank: a collective
            full[id(param)] = value.cpu() if owned(len(full)) else None
        if full[id(param)] is not None:
            state[name] = _as_saved(full[id(param)], to_saved)
    if owned(0):
        state.update(_buffers(module))
    state = rows_as_user(state, registry(module), optimizer=False)  # tp peers own the same names
    return contiguous_shards(experts_as_dtensors(state, expert_layouts(module), ep_mesh, optimizer=False))


def zero_optimizer_state(module: nn.Module, optimizer: Any, engine: Any, ep_mesh: Any) -> dict[str, Any]:
    """The optimizer entry under ZeRO: per-parameter fp32 states flattened per name, as without ZeRO
    (``state.<name>.<key>``, ``param_groups.<name>.<hyper-parameter>``), plus DeepSpeed's loss scaler.

    Collective over each ZeRO data-parallel group: call it on every rank.
    """
    from deepspeed.utils import safe_get_full_optimizer_state

    link_states(optimizer)  # every param group's views, not only the first's
    keys, step, groups = state_keys(optimizer), step_count(optimizer), group_of(optimizer)
    param_groups, owned = optimizer.optimizer.param_groups, _owned_by_this_rank(module)
    state: dict[str, Any] = {}
    seen: set[int] = set()
    for name, param, to_saved in _parameters(module):
        if id(param) in seen:  # the optimizer holds a tied weight once, under its first name
            continue
        seen.add(id(param))
        mine = owned(len(seen) - 1)
        if param.requires_grad:
            for key in keys:
                value = safe_get_full_optimizer_state(param, key)  # on every rank: a collective
                if mine:
                    state[f"state.{name}.{key}"] = _as_saved(value.detach().float().cpu(), to_saved)
            if step is not None and mine:  # a tensor, as torch keeps it (CPU Adam's int converts on load)
                state[f"state.{name}.step"] = step if torch.is_tensor(step) else torch.tensor(float(step))
        group = groups.get(id(param))
        if group is not None and mine:
            for key, value in param_groups[group].items():
                if key != "params":
                    state[f"param_groups.{name}.{key}"] = value
    state = rows_as_user(state, registry(module), optimizer=True)
    state = contiguous_shards(experts_as_dtensors(state, expert_layouts(module), ep_mesh, optimizer=True))
    state[_SCALER_KEY] = loss_scaler_state(optimizer)
    state[_ENGINE_KEY] = {k: int(getattr(engine, k)) for k in _ENGINE_COUNTERS if hasattr(engine, k)}
    return state


# ---- load -------------------------------------------------------------------------------------


def _zeros_like_saved(param: nn.Parameter, to_saved: Any) -> Any:
    """Where a saved weight is read to: fp32, whole (its tensor-parallel shard), on the CPU (the accelerator
    holds only partitions under ZeRO; DeepSpeed's setters copy each rank's part from here)."""
    return _as_saved(torch.zeros(_local_shape(param), dtype=torch.float32), to_saved)


def _read(path: Path, entry: str, template: dict[str, Any]) -> dict[str, Any]:
    distributed_checkpoint_load({entry: template}, path)
    return template


def load_zero_checkpoint(
    module: nn.Module, optimizer: Any, engine: Any, path: Path, ep_mesh: Any, *, strict: bool = True
) -> None:
    """Load a sharded checkpoint (saved under ZeRO or not, any layout) into a ZeRO run: masters, the
    module's copy, optimizer states, hyper-parameters and loss scaler. Collective: every rank.
    ``optimizer``/``engine`` ``None`` (evaluation: no engine): the weights only."""
    parameters = list(_parameters(module))
    layouts = expert_layouts(module)
    _load_weights(module, optimizer, path, parameters, layouts, ep_mesh, strict=strict)
    if optimizer is not None:
        _load_optimizer(optimizer, engine, path, parameters, layouts, ep_mesh, registry(module))


def _local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _load_weights(
    module: nn.Module,
    optimizer: Any,
    path: Path,
    parameters: list,
    layouts: dict,
    ep_mesh: Any,
    *,
    strict: bool,
) -> None:
    """Masters (DeepSpeed's setter), then the module's copy from the same values, then the buffers."""
    like: dict[str, Any] = {name: _zeros_like_saved(p, to_saved) for name, p, to_saved in parameters}
    like.update({k: v.clone() for k, v in _buffers(module).items()})
    like = experts_as_dtensors(like, layouts, ep_mesh, optimizer=False)
    saved = set(saved_keys(path, "state_dict"))
    missing = sorted(set(like) - saved)
    if strict and missing:
        raise ValueError(
            f"The checkpoint {str(path)!r} lacks weights of the module: {missing[:5]} ({len(missing)})."
        )
    like = {k: v for k, v in like.items() if k in saved}
    rows = registry(module)  # weights stored in a row layout: read as the user's rows, then put back
    user = rows_as_user(like, rows, optimizer=False)
    loaded = experts_as_local(
        restore_strided(_read(path, "state_dict", contiguous_shards(user)), user), layouts, optimizer=False
    )
    loaded = rows_as_stored(loaded, like, rows, optimizer=False)
    values: dict[int, torch.Tensor] = {}
    for name, param, _ in parameters:
        if name in loaded and id(param) not in values:
            values[id(param)] = _local(loaded[name])
            if optimizer is not None:
                set_full(param, values[id(param)])
    refresh_module_copy(module, optimizer, values)
    for name, buffer in _buffers(module).items():
        if name in loaded:
            buffer.copy_(loaded[name])


def _optimizer_template(
    optimizer: Any, files: dict[str, Any], parameters: list, keys: list[str]
) -> dict[str, Any]:
    """What to read of the optimizer entry: the saved keys of this rank's parameters, shaped as they are here."""
    groups = group_of(optimizer)
    template: dict[str, Any] = {}
    for name, param, to_saved in parameters:
        for key in keys:
            if f"state.{name}.{key}" in files:
                template[f"state.{name}.{key}"] = _zeros_like_saved(param, to_saved)
        step = files.get(f"state.{name}.step")
        if step is not None:
            template[f"state.{name}.step"] = torch.zeros(step.size, dtype=step.properties.dtype)
        group = groups.get(id(param))
        if group is not None:
            for key, value in optimizer.optimizer.param_groups[group].items():
                if key != "params" and f"param_groups.{name}.{key}" in files:
                    template[f"param_groups.{name}.{key}"] = value
    for extra in (_SCALER_KEY, _ENGINE_KEY):
        template[extra] = {k[len(extra) + 1 :]: 0 for k in files if k.startswith(f"{extra}.")}
    return template


def _load_optimizer(
    optimizer: Any, engine: Any, path: Path, parameters: list, layouts: dict, ep_mesh: Any, rows: dict
) -> None:
    """Per-parameter states, step and hyper-parameters (the LR scheduler's state is Lightning's), loss scaler."""
    files = saved_keys(path, "optimizer_0")
    keys = sorted({k.rpartition(".")[2] for k in files if k.startswith("state.")} - {"step"})
    stored = _optimizer_template(optimizer, files, parameters, keys)
    template = experts_as_dtensors(
        rows_as_user(stored, rows, optimizer=True), layouts, ep_mesh, optimizer=True
    )
    state = experts_as_local(
        restore_strided(_read(path, "optimizer_0", contiguous_shards(template)), template),
        layouts,
        optimizer=True,
    )
    state = rows_as_stored(state, stored, rows, optimizer=True)
    step = next((v for k, v in state.items() if k.startswith("state.") and k.endswith(".step")), None)
    ensure_state(optimizer, keys, step)
    groups, done = group_of(optimizer), set()
    for name, param, _ in parameters:
        if id(param) in done:
            continue
        done.add(id(param))
        for key in keys:
            if f"state.{name}.{key}" in state:
                set_full(param, _local(state[f"state.{name}.{key}"]), key)
        group, prefix = groups.get(id(param)), f"param_groups.{name}."
        for key, value in state.items():
            if group is not None and key.startswith(prefix):
                optimizer.optimizer.param_groups[group][key[len(prefix) :]] = value
    scaler = getattr(optimizer, "loss_scaler", None)
    for key, value in state.get(_SCALER_KEY, {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)
    for key, value in state.get(_ENGINE_KEY, {}).items():
        if hasattr(engine, key):
            setattr(engine, key, value)
