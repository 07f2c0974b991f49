"""Checkpoint entries in the user's layout, whatever the parallel layout holds.

Lightning's distributed-checkpoint code assumes each rank's shard is one box of the global
tensor. Two layouts of ours are not:

- fused projections (q|k|v) are ``_StridedShard``: each rank holds several pieces, which
  ``torch.distributed.checkpoint`` rejects as overlapping on save, and which Lightning's
  consolidated-file loader would cut wrongly on load;
- expert slices (expert parallelism) are plain tensors with the same name and different rows on
  every ep rank.

These conversions happen at the boundary: the files always hold the user's own layout (fused
tensors as row shards, stacked experts whole), and the model keeps its own placements. Used by
the strategy's checkpoint hooks (``strategy/checkpointing.py``), ZeRO's checkpoints
(``checkpoint/zero.py``) and ``load_weights`` (``checkpoint/transfer.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel.compat import StridedShard
from lightning_parallel.experts import expert_shard

# Optimizer state keyed per parameter name ("param_groups.<fqn>.lr", "state.<fqn>.exp_avg"), not
# as one list of parameter groups: under pipeline parallelism each rank holds different
# parameters, and a shared list would be saved by one rank only and loaded wrongly by the rest.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def map_tensors(state: Any, fn: Callable[[Any, Any], Any], like: Any = None) -> Any:
    """Apply ``fn(value, like_value)`` to every tensor of a nested state dict (dicts and lists)."""
    if isinstance(state, dict):
        return {k: map_tensors(v, fn, like[k] if like is not None else None) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(
            map_tensors(v, fn, like[i] if like is not None else None) for i, v in enumerate(state)
        )
    return fn(state, like) if isinstance(state, torch.Tensor) else state


def is_strided(value: Any) -> bool:
    return isinstance(value, DTensor) and any(isinstance(p, StridedShard) for p in value.placements)


def contiguous_shards(state: Any) -> Any:
    """Fused projections (q|k|v) are ``_StridedShard``: each rank's shard is several pieces of the
    global tensor, which ``torch.distributed.checkpoint`` cannot describe (it saves one box per
    rank and rejects them as overlapping). Checkpoints hold them as plain ``Shard(dim)``: the
    same global tensor, so the files keep the user's layout."""

    def contiguous(value: Any, _: Any) -> Any:
        if not is_strided(value):
            return value
        placements = [Shard(p.dim) if isinstance(p, StridedShard) else p for p in value.placements]
        return value.redistribute(value.device_mesh, placements)

    return map_tensors(state, contiguous)


def restore_strided(loaded: Any, like: Any) -> Any:
    """Inverse of :func:`contiguous_shards`: back to the placements of ``like``."""

    def restore(value: Any, original: Any) -> Any:
        return (
            value.redistribute(original.device_mesh, original.placements) if is_strided(original) else value
        )

    return map_tensors(loaded, restore, like)


def expert_layouts(model: torch.nn.Module) -> dict[str, Any]:
    """Parameters that hold a slice of a stacked expert weight (expert parallelism), by name."""
    out = {}
    for name, param in model.named_parameters():
        shard = expert_shard(param)
        if shard is not None and shard.dim == 0 and shard.ep_size > 1:
            out[name] = shard
    return out


def owner_name(key: str, *, optimizer: bool) -> str:
    """The parameter name of a state-dict key (flattened optimizer keys are ``state.<fqn>.<state>``)."""
    if not optimizer:
        return key
    return key[len("state.") :].rpartition(".")[0] if key.startswith("state.") else ""


def experts_as_dtensors(
    state: dict[str, Any], layouts: dict[str, Any], mesh: Any, *, optimizer: bool, replicas_mesh: Any = None
) -> dict[str, Any]:
    """Expert slices are the same name on every ep rank with different rows: as plain tensors,
    ``torch.distributed.checkpoint`` would keep one rank's rows. As ``Shard(0)`` DTensors over the
    ``ep`` axis the files hold the whole stacked tensor, which also reshards to another ``ep``.

    Under ZeRO on FSDP2 each slice is itself a DTensor, sharded over the slice's replicas along a
    later dim (``zero/fsdp.py: expert_placement``): on ``replicas_mesh`` (the ``(dp_replicate, ep)``
    mesh) it becomes that shard and ``Shard(0)`` over ``ep``, one box of the whole stacked tensor.
    """
    if not layouts:
        return state
    out = dict(state)
    for key, value in state.items():
        shard = layouts.get(owner_name(key, optimizer=optimizer))
        if shard is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.shape[0] != shard.local_rows:
            continue
        global_shape = torch.Size((shard.global_rows, *value.shape[1:]))
        stride = torch.empty(global_shape, device="meta").stride()
        if isinstance(value, DTensor):
            if replicas_mesh is None or value.device_mesh.ndim != 1:
                continue
            out[key] = DTensor.from_local(
                value.to_local(),
                replicas_mesh,
                [value.placements[0], Shard(0)],
                run_check=False,
                shape=global_shape,
                stride=stride,
            )
            continue
        out[key] = DTensor.from_local(
            value, mesh, [Shard(0)], run_check=False, shape=global_shape, stride=stride
        )
    return out


def experts_as_local(
    state: dict[str, Any], layouts: dict[str, Any], *, optimizer: bool, like: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Inverse of :func:`experts_as_dtensors`; ``like``: the state before it, whose FSDP2 shards come back."""
    if not layouts:
        return state

    def local(key: str, value: Any) -> Any:
        if not isinstance(value, DTensor) or owner_name(key, optimizer=optimizer) not in layouts:
            return value
        original = like.get(key) if like is not None else None
        if isinstance(original, DTensor):
            if original.device_mesh is value.device_mesh:
                return value
            return DTensor.from_local(
                value.to_local(),
                original.device_mesh,
                original.placements,
                run_check=False,
                shape=original.shape,
                stride=original.stride(),
            )
        return value.to_local()

    return {k: local(k, v) for k, v in state.items()}


def saved_keys(path: Any, entry: str) -> dict[str, Any]:
    """``key -> storage metadata`` of one entry of a DCP checkpoint (what the files hold, before reading)."""

    prefix = f"{entry}."
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k[len(prefix) :]: v for k, v in metadata.items() if k.startswith(prefix)}


def hyper_parameters_to_read(state: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """The flat optimizer entry less the parameter-group options the checkpoint does not hold.

    Another optimizer class may have saved it (DeepSpeed's CPU Adam has no ``maximize``, torch's AdamW no
    ``bias_correction``): those options keep this optimizer's values; per-parameter states are all read.
    """
    return {k: v for k, v in state.items() if k in saved or not k.startswith("param_groups.")}


def rename_parameters(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A flat optimizer entry (``state.<fqn>.<state>``, ``param_groups.<fqn>.<option>``) with each parameter
    of ``names`` under its new name.

    A module several blocks share is known to a pipeline stage by its own blocks' name for it, and to one
    process by the first block's (the optimizer's keys name each weight once): files hold the one-process
    name (``StageLayout.aliases_on_rank``), so any layout reads them.
    """
    if not names:
        return state
    out = {}
    for key, value in state.items():
        kind, _, rest = key.partition(".")
        fqn, _, leaf = rest.rpartition(".")
        out[f"{kind}.{names.get(fqn, fqn)}.{leaf}" if fqn in names else key] = value
    return out
