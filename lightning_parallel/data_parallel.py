"""Synchronous data parallelism over the mesh's ``dp`` axis, composable with tensor parallelism.

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
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def apply_data_parallel(root: nn.Module, dp_mesh: DeviceMesh, block_names: list[str]) -> list[nn.Module]:
    """Replicate every block, then each parameter-holding child of ``root``; returns the units.

    ``root`` (the LightningModule) is not wrapped itself: Lightning calls ``training_step``,
    not ``forward``, so hooks on the root would not fire. Its children are what the user's
    step calls.
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    units: list[nn.Module] = []
    for name in block_names:
        units.append(replicate(root.get_submodule(name), mesh=dp_mesh))
    pending = [child for child in root.children() if _has_params(child)]
    while pending:
        child = pending.pop(0)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            # Containers have no forward to hook; their members are called one by one.
            pending[:0] = [c for c in child.children() if _has_params(c) and c not in units]
        else:
            units.append(replicate(child, mesh=dp_mesh))
    return units


def average_direct_parameters(root: nn.Module, dp_mesh: DeviceMesh) -> list[RemovableHandle]:
    """All-reduce (mean) the grads of parameters registered directly on ``root``."""
    group = dp_mesh.get_group()
    size = dp_mesh.size()

    def hook(param: torch.Tensor) -> None:
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        dist.all_reduce(grad, group=group)
        grad.div_(size)

    return [p.register_post_accumulate_grad_hook(hook) for p in root.parameters(recurse=False) if p.requires_grad]


@contextmanager
def no_gradient_sync(units: list[nn.Module]) -> Iterator[None]:
    """Skip the gradient all-reduce while accumulating micro-batches (Lightning's ``accumulate_grad_batches``)."""
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)
