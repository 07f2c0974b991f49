"""Tensor-parallel styles for norms inside attention, where each rank holds only its own heads.

Models normalise queries and keys in three ways, each needing its own treatment once the heads
are split over the tensor-parallel ranks:

- over each head's ``head_dim`` with one weight shared by all heads (Qwen3, Gemma 3): torch's
  ``SequenceParallel`` over the heads' dimension (``plans/auto.py``), so the shared weight's
  gradient, a partial sum on each rank, is summed;
- over each head's ``head_dim`` with a weight per head (Cohere's ``(heads, head_dim)``):
  :class:`HeadShardedNorm` cuts the weight along its heads like the input, no communication;
- over the whole projection width (OLMo 2, OLMoE: statistics across heads other ranks hold):
  :class:`GatheredNorm` all-gathers the input, runs the norm whole with its replicated weight
  and keeps this rank's features of the output. (Megatron reduces the statistic instead; this
  form needs nothing of the norm's formula, so it serves any norm, at the cost of one all-gather
  of the projection's output per norm.)

Each is chosen by the weight's shape and checked, like every plan, by the block verification.

The norms of the residual stream under sequence parallelism are torch's ``SequenceParallel``, as
:class:`ResidualNorm`: some models call them on the tokens flattened to ``(tokens, width)``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel


def _local(output: Any) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


class GatheredNorm(ParallelStyle):
    """The norm of features split over the ranks along ``dim``: gathered, normalised whole, cut back.

    A norm planned so because its width is an MLP's hidden width may be applied to the MLP's output when the
    two widths are equal (ERGO's shared expert normalises its exit's output): an input already of the norm's
    whole width is replicated, normalised as it is and handed back whole."""

    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    @staticmethod
    def _gather(dim: int, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        weight = getattr(module, "weight", None)
        whole = (
            isinstance(weight, torch.Tensor)
            and not isinstance(x, DTensor)
            and x.shape[dim] == weight.shape[-1]
        )
        module.__dict__["_lp_gathered"] = not whole
        if whole:
            return (DTensor.from_local(x, mesh, [Replicate()], run_check=False), *inputs[1:])
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(dim % x.dim())], run_check=False)
        return (x.redistribute(mesh, [Replicate()]), *inputs[1:])

    @staticmethod
    def _cut(dim: int, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(output, DTensor):
            return output
        if not module.__dict__.get("_lp_gathered", True):
            return output.to_local()
        return output.redistribute(mesh, [Shard(dim % output.dim())]).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # no partition function: the weights are replicated
        return distribute_module(
            module, device_mesh, None, partial(self._gather, self.dim), partial(self._cut, self.dim)
        )

    def __repr__(self) -> str:
        return f"GatheredNorm(dim={self.dim})"


class HeadShardedNorm(ParallelStyle):
    """A norm with one weight per head (``(heads, head_dim)``): the weight cut along its heads like the input's
    heads dimension (``-2``, input ``(..., heads, head_dim)``); each rank normalises its own heads."""

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    @staticmethod
    def _shard_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False)
        return (x, *inputs[1:])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition, self._shard_input, lambda mod, out, mesh: _local(out)
        )

    def __repr__(self) -> str:
        return "HeadShardedNorm(heads=Shard(0))"


class ResidualNorm(SequenceParallel):
    """torch's ``SequenceParallel`` for a norm of the residual stream: each rank normalises its slice of the
    sequence, and the weight's partial gradients are summed. A model may call the norm on its tokens flattened
    to ``(tokens, width)`` (OPT before its MLP): such an input is cut along its tokens, not its second
    dimension (the features)."""

    def __init__(self) -> None:
        super().__init__(use_local_output=True)

    @staticmethod
    def _prepare_input_fn(
        sequence_sharding: Any, mod: nn.Module, inputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        tensor = inputs[0]
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor) and tensor.dim() == 2:
            sequence_sharding = (Shard(0),)
        return SequenceParallel._prepare_input_fn(sequence_sharding, mod, inputs, device_mesh)
