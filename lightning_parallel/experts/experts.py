"""Expert MLPs stored as stacked 3-D weights and computed with grouped matrix multiplies.

Tokens arrive sorted by expert with a count per expert; one grouped matmul per projection
computes every expert at once (``torch.nn.functional.grouped_mm``: measured working on CPU in
torch 2.13 for fp32 and bf16, forward and backward, empty groups included). Where it is missing
or refuses the input, a padded batched matmul does the same work.

Weights are stacked along dim 0, one slice per expert, so expert parallelism keeps a contiguous
slice of each tensor under the same parameter name (see ``parallel.py``).

Shape legend: M routed tokens (sorted by expert), E experts held here, H model width,
F expert hidden width.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.compat import grouped_mm

Activation = Literal["gelu", "swiglu", "relu", "silu"]
_GROUPED_MM = grouped_mm


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    ``grouped_mm``'s backward rejects expanded gradients (strides 0, e.g. from ``out.sum()``).
    """

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _padded_bmm(x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The grouped matmul as one ``bmm`` over groups padded to the largest one."""
    num_groups = w_EKN.shape[0]
    counts = counts_E.tolist()
    longest = max(counts, default=0)
    if longest == 0:
        return x_MK @ w_EKN[0]  # no rows, but in the graph: the weights get zero gradients
    group_M = torch.repeat_interleave(
        torch.arange(num_groups, device=x_MK.device), counts_E, output_size=x_MK.shape[0]
    )
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    slot_M = torch.arange(x_MK.shape[0], device=x_MK.device) - starts_E[group_M]
    padded = x_MK.new_zeros(num_groups, longest, x_MK.shape[-1]).index_put((group_M, slot_M), x_MK)
    return torch.bmm(padded, w_EKN)[group_M, slot_M]


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """``y[rows of group e] = x[rows of group e] @ w[e]``; rows grouped in order, ``counts_E`` each.

    Under autocast the operands are cast to the autocast dtype (``grouped_mm`` has no autocast
    rule and would silently stay in fp32).
    """
    device_type = x_MK.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x_MK, w_EKN = x_MK.to(dtype), w_EKN.to(dtype)
    elif x_MK.dtype != w_EKN.dtype:
        x_MK = x_MK.to(w_EKN.dtype)
    if _GROUPED_MM is not None:
        try:
            offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
            return _ContiguousGrad.apply(_GROUPED_MM(x_MK, w_EKN, offs=offsets_E))
        except (RuntimeError, NotImplementedError):
            pass  # an unsupported dtype or layout on this device: the fallback handles every case
    return _padded_bmm(x_MK, w_EKN, counts_E)


def _add_grouped_bias(y_MN: torch.Tensor, b_EN: torch.Tensor | None, counts_E: torch.Tensor) -> torch.Tensor:
    if b_EN is None:
        return y_MN
    return y_MN + torch.repeat_interleave(b_EN.to(y_MN.dtype), counts_E, dim=0, output_size=y_MN.shape[0])


class GroupedExperts(nn.Module):
    """``num_experts`` two-layer MLPs with the weights of all experts in one tensor per layer.

    Parameters (names are part of the checkpoint format; dim 0 is the expert):

    - ``w_in``: ``(E, H, F)``, or ``(E, H, 2F)`` for ``swiglu`` (gate columns first, then up).
    - ``w_out``: ``(E, F, H)``.
    - ``b_in``, ``b_out``: ``(E, F or 2F)``, ``(E, H)`` when ``bias=True``.

    ``x @ w`` (not ``x @ w.T`` as ``nn.Linear``) because that is the layout grouped matmuls
    consume without a transpose; ``from_linear`` converts dense ``nn.Linear`` weights.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        activation: Activation = "gelu",
        *,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu", "relu", "silu"):
            raise ValueError(f"`activation={activation!r}` must be one of 'gelu', 'swiglu', 'relu', 'silu'.")
        self.dim, self.hidden_dim, self.num_experts = dim, hidden_dim, num_experts
        self.activation = activation
        in_width = 2 * hidden_dim if activation == "swiglu" else hidden_dim
        self.w_in = nn.Parameter(torch.empty(num_experts, dim, in_width))
        self.w_out = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.b_in = nn.Parameter(torch.zeros(num_experts, in_width)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(num_experts, dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default initialisation, expert by expert."""
        for weight, fan_in in ((self.w_in, self.dim), (self.w_out, self.hidden_dim)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(weight, -bound, bound)
        for bias in (self.b_in, self.b_out):
            if bias is not None:
                nn.init.zeros_(bias)

    @torch.no_grad()
    def load_dense(
        self, expert: int, fc_in: nn.Linear, fc_out: nn.Linear, fc_up: nn.Linear | None = None
    ) -> None:
        """Copy a dense MLP (``nn.Linear`` in, optional up for swiglu, out) into expert ``expert``."""
        w_in = fc_in.weight.t() if fc_up is None else torch.cat([fc_in.weight.t(), fc_up.weight.t()], dim=1)
        self.w_in[expert].copy_(w_in)
        self.w_out[expert].copy_(fc_out.weight.t())
        if self.b_in is not None:
            b_in = fc_in.bias if fc_up is None else torch.cat([fc_in.bias, fc_up.bias])
            self.b_in[expert].copy_(b_in)
            self.b_out[expert].copy_(fc_out.bias)

    def _activate(self, h_MF: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, up = h_MF.chunk(2, dim=-1)
            return F.silu(gate) * up
        return {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[self.activation](h_MF)

    def forward(self, x_MH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Rows of ``x_MH`` grouped by expert (``counts_E[e]`` rows for expert e, in order)."""
        h_MF = _add_grouped_bias(grouped_mm(x_MH, self.w_in, counts_E), self.b_in, counts_E)
        h_MF = self._activate(h_MF)
        y_MH = _add_grouped_bias(grouped_mm(h_MF, self.w_out, counts_E), self.b_out, counts_E)
        return y_MH.to(x_MH.dtype) if not torch.is_autocast_enabled(x_MH.device.type) else y_MH

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}, {self.activation}"
        )
