"""Hooked data parallelism over the mesh's ``dp`` axis, composable with tensor parallelism.

Built on torch's FSDP2-based ``replicate`` (the successor of DDP): it accepts parameters that
are already DTensors on the ``tp`` axis, averages gradients over ``dp`` only, and overlaps the
all-reduce with backward because each block is its own communication unit. Parameters that
the user registered directly on the LightningModule (rare) are averaged by a gradient hook.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_parallel.compat import ddp_replicate, fsdp_replicate


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket: large enough to amortise a collective's latency


def _bucket_blocks(blocks: list[nn.Module], bucket_bytes: int) -> list[list[nn.Module]]:
    """Consecutive blocks grouped until a group holds ``bucket_bytes`` of parameters.

    One communication unit per block would issue one all-reduce per block: for small blocks
    the per-collective latency dominates (measured: 8% slower than DDP's single bucket on a
    small GPT). Groups of about DDP's bucket size keep the overlap with backward for large
    models and one collective for small ones.
    """
    groups: list[list[nn.Module]] = [[]]
    size = 0
    for block in blocks:
        if groups[-1] and size >= bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(block)
        size += sum(p.numel() * p.element_size() for p in block.parameters())
    return [g for g in groups if g]


def apply_data_parallel(
    root: nn.Module,
    dp_mesh: DeviceMesh,
    block_names: list[str],
    bucket_bytes: int = BUCKET_BYTES,
    *,
    sharded_parameters: bool = True,
) -> list[nn.Module]:
    """Replicate groups of blocks, then each parameter-holding child of ``root``; returns the units.

    Without tensor parallelism (``sharded_parameters=False``) the parameters are plain
    tensors and torch's DDP reducer (``_composable.replicate``: in place, no wrapper, so the
    user's attribute paths stay valid) is used: measured 8% faster than FSDP2's ``replicate``
    for pure data parallelism, whose DTensor parameters cost dispatch time in every optimizer op.

    ``root`` (the LightningModule) is not wrapped itself: Lightning calls ``training_step``,
    not ``forward``, so hooks on the root would not fire. Its children are what the user's
    step calls.
    """
    replicate = fsdp_replicate()
    if not sharded_parameters:
        children = _parameter_holders(root)
        for child in children:
            # DDP's own buckets (1 MB first, then 25 MB)
            ddp_replicate()(child, process_group=dp_mesh.get_group())
        return children

    units: list[nn.Module] = []
    blocks = [root.get_submodule(name) for name in block_names]
    for group in _bucket_blocks(blocks, bucket_bytes):
        replicate(group if len(group) > 1 else group[0], mesh=dp_mesh)
        units.extend(group)
    for child in _parameter_holders(root, skip=units):
        units.append(replicate(child, mesh=dp_mesh))
    return units


def _parameter_holders(root: nn.Module, skip: list[nn.Module] | None = None) -> list[nn.Module]:
    """Children of ``root`` with parameters; containers (no forward to hook) are opened."""
    skip = skip or []
    found: list[nn.Module] = []
    pending = [child for child in root.children() if _has_params(child)]
    while pending:
        child = pending.pop(0)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            pending[:0] = [c for c in child.children() if _has_params(c) and c not in skip]
        else:
            found.append(child)
    return found


def average_direct_parameters(root: nn.Module, dp_mesh: DeviceMesh) -> list[RemovableHandle]:
    """All-reduce (mean) the grads of parameters registered directly on ``root``."""
    group = dp_mesh.get_group()
    size = dp_mesh.size()

    def hook(param: torch.Tensor) -> None:
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        dist.all_reduce(grad, group=group)
        grad.div_(size)

    return [
        p.register_post_accumulate_grad_hook(hook) for p in root.parameters(recurse=False) if p.requires_grad
    ]


@contextmanager
def no_gradient_sync(units: list[nn.Module]) -> Iterator[None]:
    """Skip the gradient all-reduce while accumulating micro-batches (Lightning's ``accumulate_grad_batches``)."""

    def set_sync(unit: nn.Module, *, enabled: bool) -> None:
        if isinstance(unit, FSDPModule):
            unit.set_requires_gradient_sync(enabled, recurse=False)
        else:  # torch's composable DDP reducer
            unit.set_requires_gradient_sync(enabled)

    for unit in units:
        set_sync(unit, enabled=False)
    try:
        yield
    finally:
        for unit in units:
            set_sync(unit, enabled=True)
