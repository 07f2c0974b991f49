"""ZeRO-3 as torch's FSDP2 (``fully_shard``) over the data-parallel ranks of tensor-parallel DTensor weights.

torchtitan's 2-D layout: each tensor-parallel shard is sharded again over ``dp``, so a rank holds
``1 / (tp x dp)`` of every weight, its gradient and its optimizer state (the ZeRO-3 memory
contract); a block's weights are all-gathered over ``dp`` just before it runs (forward, and again
in backward) and its gradients reduce-scattered right after, overlapping the backward of the
blocks below. Each block is one unit (its own all-gather), the rest of each top-level module
another; the LightningModule itself is never one (Lightning calls ``training_step``, not
``forward``, so its hooks would not fire).

Fused projections (q|k|v) are ``_StridedShard`` on dim 0 over ``tp``; FSDP2 shards their weights
along dim 1 instead (``shard_placement``), which it composes with a strided placement. A fused
projection's bias has no other dim, and FSDP2's strided placement over ``dp`` on top of the
strided one over ``tp`` mixed its rows (measured: the biases of ``c_attn`` wrong after a step);
those few vectors stay whole over ``dp`` (``ignored_params``) and their gradients are averaged
over ``dp`` after backward, with the other explicit reductions (``parallelize/gradients.py``).

``offload="cpu"``: FSDP2's ``CPUOffloadPolicy``: the sharded parameters, their gradients and the
optimizer (state and step) live on the CPU, copied to the device for each all-gather.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def shard_placement(param: nn.Parameter) -> Shard:
    """FSDP2's placement over ``dp``: dim 0, unless tensor parallelism cut dim 0 into strided pieces."""
    strided = isinstance(param, DTensor) and any(
        isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements
    )
    return Shard(1) if strided and param.dim() > 1 else Shard(0)


def _is_strided(param: nn.Parameter) -> bool:
    return isinstance(param, DTensor) and any(
        isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements
    )


def unsharded_parameters(root: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP2 leaves whole over ``dp``: strided vectors (fused projections' biases)."""
    return [p for p in root.parameters() if p.dim() == 1 and _is_strided(p)]


def _holders(root: nn.Module, skip: set[int]) -> list[nn.Module]:
    """Children of ``root`` that own parameters (containers opened), not already units."""
    found, pending = [], [c for c in root.children() if any(True for _ in c.parameters())]
    while pending:
        child = pending.pop(0)
        if id(child) in skip:
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            pending[:0] = [c for c in child.children() if any(True for _ in c.parameters())]
        else:
            found.append(child)
    return found


def fully_shard_modules(
    root: nn.Module, dp_mesh: DeviceMesh, blocks: list[nn.Module], offload: bool
) -> list[nn.Module]:
    """``fully_shard`` every block, then every other parameter-holding child of ``root``; returns the units."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    ignored = set(unsharded_parameters(root))
    kwargs = {
        "mesh": dp_mesh,
        "shard_placement_fn": shard_placement,
        "offload_policy": policy,
        "ignored_params": ignored,
    }
    units = [fully_shard(block, **kwargs) for block in blocks if any(True for _ in block.parameters())]
    units += [fully_shard(holder, **kwargs) for holder in _holders(root, {id(u) for u in units})]
    return units
