"""Multi-head latent attention under tensor parallelism: a small latent made whole, read by split projections.

DeepSeek-V2/V3 (and Kimi, MiniCPM3, LongCat, ...) project the hidden state down to a low-rank latent
(``q_a_proj``, ``kv_a_proj_with_mqa``), normalise it, and project it up to the heads (``q_b_proj``,
``kv_b_proj``). The latent is small, so every rank makes it whole (the maker stays replicated) and the
up-projections are column parallel: each rank reads the whole latent and writes its own heads.

The latent's gradient then arrives in two kinds of shares. Through the up-projections, each rank holds
its heads' part of it; through the code that uses the latent directly (the rotary key that
``kv_a_proj_with_mqa`` makes beside the latent and every head shares), each rank holds its heads' part
too. Both are partial sums over the ranks, and the maker needs their total: the readers therefore leave
their input gradient unreduced (:class:`LatentReader`) and the maker's output sums the whole gradient once
(:class:`LatentMaker`), one all-reduce of the latent's gradient per maker.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_parallel.tensor_parallel.styles import ColwiseProjection


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReplicatedKeepingShares(torch.autograd.Function):
    """A local tensor as a replicated DTensor whose gradient comes back as this rank's share, unreduced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        ctx.size = mesh.size()
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None]:
        if isinstance(grad.placements[0], Partial):
            return grad.to_local(), None
        return grad.to_local() / ctx.size, None  # a whole gradient: each rank's even share of it


class LatentMaker(ParallelStyle):
    """The projection making a latent: weights whole on every rank; its output's gradient summed over them."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def hook(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            return _SumGradient.apply(output, group) if output.requires_grad else output

        module.register_forward_hook(hook)
        return module

    def __repr__(self) -> str:
        return "LatentMaker(R, grad summed)"


class LatentReader(ColwiseProjection):
    """Column parallel over a latent every rank holds whole; its input gradient left as this rank's share."""

    @staticmethod
    def _keep_shares(
        input_layouts: Any, desired: Any, mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh
    ) -> tuple[Any, ...]:
        x = inputs[0]
        if isinstance(x, DTensor):
            return inputs
        return (_ReplicatedKeepingShares.apply(x, mesh), *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:

        return distribute_module(
            module,
            device_mesh,
            self._partition_projection_fn,
            partial(self._keep_shares, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return "LatentReader(Colwise, input grad kept as shares)"
