"""Checkpoint entries of weights stored in a row layout, in the user's rows (``tensor_parallel/row_layout.py``).

A fused q|k|v of unequal widths is stored in another row order, and k/v heads fewer than the
tensor-parallel ranks on several ranks: the stored tensor is not the user's. At the checkpoint
boundary each such entry (the weight and its optimizer states) becomes the user's tensor:
gathered over ``tp`` along its rows, put in the user's order (one copy of each row), and saved as
replicated over ``tp`` (other mesh axes, FSDP2's ``dp``, keep their shards, which cut other dims);
loading takes the rows this rank stores back out of it. So the files hold the user's layout and
reshard into any other layout, and a checkpoint of any layout loads into this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel.checkpoint.layouts import owner_name
from lightning_parallel.mesh import Axis
from lightning_parallel.tensor_parallel.row_layout import REGISTRY, RowLayout


def registry(model: torch.nn.Module) -> dict[str, RowLayout]:
    """``{parameter name: layout}`` of the weights tensor parallelism stored in a row layout."""
    return getattr(model, REGISTRY, {})


def _tp_dim(value: DTensor) -> int:
    return list(value.device_mesh.mesh_dim_names or ()).index(Axis.TP)


def _shape(value: DTensor, dim: int, rows: int) -> tuple[torch.Size, tuple[int, ...]]:
    shape = list(value.shape)
    shape[dim] = rows
    return torch.Size(shape), torch.empty(shape, device="meta").stride()


def to_user(value: DTensor, layout: RowLayout) -> DTensor:
    """The user's tensor of a stored one, replicated over ``tp``."""
    mesh, t = value.device_mesh, _tp_dim(value)
    local, group = value.to_local().contiguous(), mesh.get_group(t)
    # ZeRO's checkpoints hold the masters on the CPU; NCCL gathers only on the accelerator.
    on = torch.device(mesh.device_type) if dist.get_backend(group) == "nccl" else local.device
    pieces = [torch.empty_like(local, device=on) for _ in range(mesh.size(t))]
    dist.all_gather(pieces, local.to(on), group=group)
    user = layout.user(torch.cat(pieces, dim=layout.dim).to(local.device))
    placements = list(value.placements)
    placements[t] = Replicate()
    shape, stride = _shape(value, layout.dim, layout.rows)
    return DTensor.from_local(user, mesh, placements, run_check=False, shape=shape, stride=stride)


def to_stored(value: DTensor, layout: RowLayout, like: DTensor) -> DTensor:
    """Inverse of :func:`to_user`: this rank's stored rows of the user's tensor, in ``like``'s placements."""
    stored = layout.stored(value.to_local())
    rank = like.device_mesh.get_local_rank(_tp_dim(like))
    mine = stored.narrow(layout.dim, rank * layout.per_rank, layout.per_rank).contiguous()
    return DTensor.from_local(
        mine, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _layout_of(key: str, value: Any, layouts: dict[str, RowLayout], *, optimizer: bool) -> RowLayout | None:
    layout = layouts.get(owner_name(key, optimizer=optimizer))
    if layout is None or not isinstance(value, DTensor) or value.dim() <= layout.dim:
        return None
    return layout if value.shape[layout.dim] == len(layout.index) else None


def rows_as_user(state: dict[str, Any], layouts: dict[str, RowLayout], *, optimizer: bool) -> dict[str, Any]:
    """Every stored-layout entry of a (flat) state dict as the user's tensor."""
    if not layouts:
        return state
    out = dict(state)
    for key, value in state.items():
        if (layout := _layout_of(key, value, layouts, optimizer=optimizer)) is not None:
            out[key] = to_user(value, layout)
    return out


def rows_as_stored(
    loaded: dict[str, Any], like: dict[str, Any], layouts: dict[str, RowLayout], *, optimizer: bool
) -> dict[str, Any]:
    """Inverse of :func:`rows_as_user`; ``like``: the state before it (the stored tensors' placements)."""
    if not layouts:
        return loaded
    out = dict(loaded)
    for key, value in loaded.items():
        original = like.get(key)
        if (layout := _layout_of(key, original, layouts, optimizer=optimizer)) is not None and isinstance(
            value, DTensor
        ):
            out[key] = to_stored(value, layout, original)
    return out


def _fits(value: Any, layout: RowLayout, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > layout.dim and value.shape[layout.dim] == rows


def full_rows_as_user(state: dict[str, Any], layouts: dict[str, RowLayout]) -> dict[str, Any]:
    """A consolidated (full, plain) model state dict: stored tensors as the user's."""
    return {
        key: layouts[key].user(value)
        if key in layouts and _fits(value, layouts[key], len(layouts[key].index))
        else value
        for key, value in state.items()
    }


def full_rows_as_stored(state: dict[str, Any], layouts: dict[str, RowLayout]) -> dict[str, Any]:
    """The user's full tensors of a consolidated state dict in the stored layouts (before they are distributed)."""
    return {
        key: layouts[key].stored(value)
        if key in layouts and _fits(value, layouts[key], layouts[key].rows)
        else value
        for key, value in state.items()
    }


def _per_parameter(
    state: dict[str, Any], layouts: dict[str, RowLayout], convert: Callable[[dict, dict], dict]
) -> dict[str, Any]:
    """A consolidated optimizer state (``{"state": {name: {state: tensor}}, ...}``), each named entry converted."""
    states = state.get("state")
    if not layouts or not isinstance(states, dict):
        return state
    converted = {
        name: convert(values, dict.fromkeys(values, layouts[name]))
        if name in layouts and isinstance(values, dict)
        else values
        for name, values in states.items()
    }
    return {**state, "state": converted}


def full_optimizer_rows_as_user(state: dict[str, Any], layouts: dict[str, RowLayout]) -> dict[str, Any]:
    """A consolidated optimizer state dict (keyed by parameter name): stored tensors as the user's."""
    return _per_parameter(state, layouts, full_rows_as_user)


def full_optimizer_rows_as_stored(state: dict[str, Any], layouts: dict[str, RowLayout]) -> dict[str, Any]:
    """The user's tensors of a consolidated optimizer state dict (keyed by parameter name) in the stored layouts."""
    return _per_parameter(state, layouts, full_rows_as_stored)
