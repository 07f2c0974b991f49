"""Tensor-parallel weights as plain local shards, so that DeepSpeed can flatten them.

ZeRO copies every parameter into flat buffers and points ``param.data`` into them: a DTensor
parameter cannot be treated so (its data is a wrapper). A parametrization keeps the module's
view unchanged (``module.weight`` is still the DTensor the tensor-parallel styles and the
model's code expect) while the registered parameter is the plain local shard; the gradient of
the shard is the DTensor gradient's local part (``DTensor.from_local`` is differentiable).
Shards that differ across tensor ranks are flagged ``tensor_model_parallel`` so that
DeepSpeed's gradient norm counts them on every rank and replicated weights once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.nn.utils import parametrize

from lightning_parallel.tensor_parallel.param_styles import SHOWN_LOCAL
from lightning_parallel.tensor_parallel.row_layout import ROW_LAYOUT, row_layout


class FromLocalShard(nn.Module):
    """``local shard -> DTensor`` with the placements and global shape the weight had."""

    def __init__(self, like: DTensor) -> None:
        super().__init__()
        self.mesh = like.device_mesh
        self.placements = tuple(like.placements)
        self.shape = like.shape
        self.stride = like.stride()
        self.row_layout = row_layout(like)

    def forward(self, local: torch.Tensor) -> DTensor:
        weight = DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )
        if self.row_layout is not None:  # rows stored in another order (tensor_parallel/row_layout.py)
            setattr(weight, ROW_LAYOUT, self.row_layout)
        return weight


class LocalView(FromLocalShard):
    """``local shard -> the local tensor the module's code sees`` for ``LocalParameters``' weights: the
    DTensor's local view, a replicated weight's gradient summed over the tensor-parallel ranks (``Partial``)."""

    def forward(self, local: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        weight = super().forward(local)
        replicated = all(isinstance(p, Replicate) for p in self.placements)
        return weight.to_local(grad_placements=[Partial()] * len(self.placements) if replicated else None)


def local_shard_parameters(module: nn.Module) -> int:
    """Re-register every DTensor parameter of ``module`` as its local shard; returns how many."""
    count = 0
    shards: dict[int, nn.Parameter] = {}  # a tied weight (embedding = head) stays one parameter
    for owner in list(module.modules()):
        for name, param in list(owner.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                continue
            sharded = any(not isinstance(p, Replicate) for p in param.placements)
            to_dtensor = LocalView(param) if getattr(param, SHOWN_LOCAL, False) else FromLocalShard(param)
            # The plain shard first, so that the parametrization adopts it as its ``original``
            # (converting a DTensor in place is refused: different tensor subclasses).
            local = shards.get(id(param))
            if local is None:
                local = shards[id(param)] = nn.Parameter(
                    param.to_local().detach(), requires_grad=param.requires_grad
                )
            owner._parameters[name] = local
            parametrize.register_parametrization(owner, name, to_dtensor, unsafe=True)
            original = getattr(owner.parametrizations, name).original
            if sharded:
                original.tensor_model_parallel = True
            count += 1
    return count


def mark_model_parallel(parameters: Any) -> None:
    """Flag plain parameters that hold a slice (expert weights under expert parallelism)."""
    for param in parameters:
        param.tensor_model_parallel = True


def parametrized(name: str) -> tuple[str, str] | None:
    """``a.b.parametrizations.weight.original`` -> ``("a.b", "weight")``; ``None`` for a plain parameter name."""
    if ".parametrizations." not in f".{name}":
        return None
    owner, _, rest = name.partition("parametrizations.")
    return owner.rstrip("."), rest.removesuffix(".original")


def user_name(name: str) -> str:
    """``a.parametrizations.weight.original`` -> ``a.weight`` (state-dict keys under ZeRO with TP)."""
    split = parametrized(name)
    if split is None:
        return name
    owner, attribute = split
    return f"{owner}.{attribute}" if owner else attribute


def user_named_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters()`` under the user's names: a parametrized weight as the module sees it."""
    out = []
    for name, param in module.named_parameters():
        split = parametrized(name)
        if split is None:
            out.append((name, param))
        else:
            out.append((user_name(name), getattr(module.get_submodule(split[0]), split[1])))
    return out


def registered_parameter(module: nn.Module, name: str) -> nn.Parameter:
    """The parameter registered under the user's ``name``: for a weight taken as its local shard, the
    parametrization's ``original`` (what DeepSpeed and the optimizer hold); else ``get_parameter``."""
    owner, _, attribute = name.rpartition(".")
    holder = module.get_submodule(owner) if owner else module
    if parametrize.is_parametrized(holder, attribute):
        return getattr(holder.parametrizations, attribute).original
    return module.get_parameter(name)
