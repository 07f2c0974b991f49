"""Adafactor that also takes DTensor parameters (tensor parallelism).

``torch.optim.Adafactor`` keeps, for each weight matrix, the mean of the squared gradient over
each row and over each column (two vectors instead of a matrix). On a DTensor sharded along
the rows or the columns one of those means runs over the sharded dimension: torch's
implementation squares that partial result in place, for which DTensor has no sharding rule
(``aten.pow_.Scalar`` on a ``_NormPartial``), and the step fails.

:class:`Adafactor` here is torch's class with the same update, written so that every partial
reduction is redistributed (one all-reduce of a vector or a scalar) to the placement of the
state it updates: the row factor of a row-sharded weight stays sharded, that of a
column-sharded weight is replicated, and the global norms (parameter RMS and update clipping)
are all-reduced. For plain tensors the step is torch's own, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import zeros as dtensor_zeros

__all__ = ["Adafactor"]


def _reduced_placements(grad: DTensor, dim: int) -> list[Any]:
    """Placements of ``grad`` after reducing ``dim`` (kept as size 1): shards of that dim become replicas."""
    dim = dim % grad.dim()
    return [Replicate() if isinstance(p, Shard) and p.dim % grad.dim() == dim else p for p in grad.placements]


def _factor(grad: DTensor, dim: int) -> DTensor:
    shape = list(grad.shape)
    shape[dim] = 1
    return dtensor_zeros(
        shape, device_mesh=grad.device_mesh, placements=_reduced_placements(grad, dim), dtype=grad.dtype
    )


def _squared_mean(grad: DTensor, dim: int, like: DTensor) -> DTensor:
    # Torch's formula: norm over ``dim``, squared, divided by the size; partial norms are combined first.
    norm = torch.norm(grad, dim=dim, keepdim=True).redistribute(like.device_mesh, like.placements)
    return norm.square().div(grad.size(dim))


def _norm(tensor: torch.Tensor) -> torch.Tensor:
    """The 2-norm as a plain 0-dim tensor on the device (read by nobody on the host: no sync per parameter)."""
    norm = tensor.norm(2)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _scaled(update: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``update * scale`` for a plain 0-dim ``scale``, replicated over ``update``'s mesh if it is a DTensor."""
    if isinstance(update, DTensor):
        mesh = update.device_mesh
        scale = DTensor.from_local(scale, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return update * scale


class Adafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` (same arguments, same update) that also steps DTensor parameters."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        params = [p for group in self.param_groups for p in group["params"]]
        if not any(isinstance(p, DTensor) for p in params):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, self.state[param], group)
        return loss

    def _update(self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        grad = -param.grad if group["maximize"] else param.grad
        if not state:
            state["step"] = torch.tensor(0.0)
            if grad.dim() > 1:
                state["row_var"] = (
                    _factor(grad, -1) if isinstance(grad, DTensor) else grad.new_zeros((*grad.shape[:-1], 1))
                )
                state["col_var"] = (
                    _factor(grad, -2)
                    if isinstance(grad, DTensor)
                    else grad.new_zeros((*grad.shape[:-2], 1, grad.shape[-1]))
                )
            else:
                state["variance"] = torch.zeros_like(grad)
        lr, eps1, eps2, d = float(group["lr"]), group["eps"][0], group["eps"][1], group["d"]
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps
        state["step"] += 1
        step = state["step"].item()  # a host tensor: no device sync
        one_minus_beta2 = step ** group["beta2_decay"]
        rho = min(lr, 1 / step**0.5)
        # torch's Adafactor reads the two norms to the host per parameter; here they stay on the device
        alpha = (_norm(param) / param.numel() ** 0.5).clamp(min=eps2) * rho
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        if grad.dim() > 1:
            row_var, col_var = state["row_var"], state["col_var"]
            if isinstance(grad, DTensor):
                row_var.lerp_(_squared_mean(grad, -1, row_var), one_minus_beta2)
                col_var.lerp_(_squared_mean(grad, -2, col_var), one_minus_beta2)
                row_scale = row_var.mean(dim=-2, keepdim=True).redistribute(
                    row_var.device_mesh, [Replicate()] * row_var.device_mesh.ndim
                )
            else:
                row_var.lerp_(
                    torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)), one_minus_beta2
                )
                col_var.lerp_(
                    torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2)), one_minus_beta2
                )
                row_scale = row_var.mean(dim=-2, keepdim=True)
            var_estimate = (row_var @ col_var).div_(row_scale.clamp(min=eps1))
        else:
            state["variance"].lerp_(grad * grad, one_minus_beta2)
            var_estimate = state["variance"].clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        denom = (_norm(update) / (update.numel() ** 0.5 * d)).clamp(min=1.0)
        param.sub_(_scaled(update, alpha / denom))
