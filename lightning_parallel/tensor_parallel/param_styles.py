"""Parameters an attention or MLP uses directly in its own code, on activations split over the ranks.

Projections and norms have styles of their own. What is left are tensors the module's ``forward`` reads as
attributes and combines with its local shard of heads or features:

- one entry per head (GPT-OSS's attention sinks ``(heads,)``, Doge's ``A``; MiniMax's decay buffers
  ``(heads, 1, 1)``): each rank needs its own heads' entries, so the tensor is cut along that dimension
  like the heads (``Shard(dim)``; a buffer is cut once, as it has no gradient);
- anything else (the scalars of a learnable activation, xIELU's ``alpha_p``; differential attention's
  ``lambda_q1``): every rank uses the whole tensor on its part of the activations, so its gradient on each
  rank is a share of the true one; it is kept whole (``Replicate``) and its gradient marked ``Partial``, the
  sum the gradient reductions make once per step (as for norms under sequence parallelism). A whole tensor
  the module hands back to its caller as one of its outputs (GPT-NeoX-Japanese's ``dense_bias``, added after
  the exit's reduction) is used on replicated activations there, without sequence parallelism: what the
  caller receives is another local view whose gradient is the whole one on every rank (``Replicate``), not a
  share. Under sequence parallelism the caller works on its sequence slice and its gradient is a share again.

The module's unchanged code must keep seeing a plain tensor: a pre-forward hook puts the local tensor
(``to_local``, differentiable) in place of the parameter and the post-forward hook puts the parameter back,
so the optimizer, checkpoints and gradient clipping see one DTensor parameter as everywhere else. Which
tensors, and along which dimension, is decided by ``plans/`` from their shapes; the block verification
checks the choice like every other part of the plan.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

_SAVED = "_lp_local_parameters"
# Marks a parameter whose module's code sees the local tensor (not the DTensor) while it runs.
SHOWN_LOCAL = "_lp_shown_local"


class LocalParameters(ParallelStyle):
    """Parameters and buffers of one module (its children's under dotted names): ``{name: dim}`` cut along
    ``dim``, ``{name: None}`` whole with a ``Partial`` gradient; the module's code sees the local tensors while
    it runs."""

    def __init__(self, dims: dict[str, int | None], *, returned_whole: bool = False) -> None:
        super().__init__()
        self.dims = dict(dims)
        # a whole parameter the module returns is used by its caller on replicated activations (no sequence
        # parallelism): its gradient there is the whole one, not a share
        self.returned_whole = returned_whole

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rank, size = device_mesh.get_local_rank(), device_mesh.size()
        parameters = []
        for name, dim in self.dims.items():
            owner, attr = _owner(module, name)
            if attr in owner._buffers and owner._buffers[attr] is not None:
                buffer = owner._buffers[attr]
                if dim is not None:  # no gradient: cut once, the module keeps a plain tensor
                    piece = buffer.shape[dim] // size
                    owner._buffers[attr] = buffer.narrow(dim, rank * piece, piece).clone()
                continue
            param = owner._parameters.get(attr)
            if param is None or isinstance(param, DTensor):
                continue
            placement = Replicate() if dim is None else Shard(dim % param.dim())
            dist = distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=None)
            owner.register_parameter(attr, nn.Parameter(dist, requires_grad=param.requires_grad))
            setattr(owner._parameters[attr], SHOWN_LOCAL, True)  # zero/tensor_parallel.py keeps it local
            parameters.append(name)
        if parameters:
            module.register_forward_pre_hook(_show_local(parameters, self.dims))
            restore = _restore_handing_back_whole if self.returned_whole else _restore
            module.register_forward_hook(restore, always_call=True)  # also when the forward raises
        return module

    def __repr__(self) -> str:
        parts = [f"{n}={'Partial grad' if d is None else f'S({d})'}" for n, d in self.dims.items()]
        return f"LocalParameters({', '.join(parts)})"


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding ``name`` (a child's, dotted: a module whose code reads its child's weights directly,
    as DBRX's experts read ``self.mlp.w1``, is given them before its code runs) and the attribute there."""
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _show_local(names: list[str], dims: dict[str, int | None]) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        saved = {}
        for name in names:
            owner, attr = _owner(module, name)
            param = owner._parameters.get(attr)  # absent: a parametrization shows the local tensor (ZeRO)
            if not isinstance(param, DTensor):  # or a re-entrant call (recomputation inside forward)
                continue
            saved[name] = param
            grad = [Partial()] if dims[name] is None else None
            owner._parameters[attr] = param.to_local(grad_placements=grad)  # type: ignore[assignment]
        module.__dict__.setdefault(_SAVED, []).append(saved)

    return hook


def _restore(module: nn.Module, args: Any, output: Any) -> None:
    stack = module.__dict__.get(_SAVED) or []
    if stack:
        for name, param in stack.pop().items():
            owner, attr = _owner(module, name)
            owner._parameters[attr] = param


def _restore_handing_back_whole(module: nn.Module, args: Any, output: Any) -> Any:
    """:func:`_restore`, and a whole parameter the module returns as one of its outputs handed back as a view
    whose gradient is the whole one on every rank (the caller uses it on replicated activations)."""
    saved = (module.__dict__.get(_SAVED) or [{}])[-1]
    returned = {
        id(_owner(module, name)[0]._parameters[_owner(module, name)[1]]): param
        for name, param in saved.items()
        if isinstance(param, DTensor) and param.placements == (Replicate(),)
    }
    _restore(module, args, output)
    if not returned or not isinstance(output, tuple) or not any(id(item) in returned for item in output):
        return None
    items = [returned[id(item)].to_local() if id(item) in returned else item for item in output]
    return type(output)(*items) if hasattr(output, "_fields") else tuple(items)  # a NamedTuple stays one
