"""Apply the tensor/sequence-parallel part of a ``ParallelPlan`` to a model, in place."""

from __future__ import annotations

import logging
from collections import defaultdict

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.hooks import RemovableHandle

from lightning_parallel.tensor_parallel.plan import ParallelPlan, ShardedContainer
from lightning_parallel.tensor_parallel.regions import install_container_hooks, install_sequence_region

log = logging.getLogger(__name__)


def _parameter_aliases(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold the same Parameter object (tied weights)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners[id(param)].append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Re-establish weight tying broken by distributing each owner's parameter separately.

    The first distributed copy wins; every other owner is pointed at it, so the tied weight
    stays one parameter (one gradient, one optimizer state) as in the unsharded model.
    """
    for group in groups:
        params = [getattr(module, name) for module, name in group]
        distributed = [p for p in params if isinstance(p, DTensor)]
        if not distributed:
            continue
        keep = distributed[0]
        for other in distributed[1:]:
            if other.placements != keep.placements:
                names = ", ".join(f"{type(m).__name__}.{n}" for m, n in group)
                raise ValueError(
                    f"Tied parameters ({names}) would be sharded differently ({keep.placements} vs"
                    f" {other.placements}); give them the same style in `plan=`."
                )
        for module, name in group:
            module.register_parameter(name, keep)


def scale_attributes(module: nn.Module, container: ShardedContainer, local: bool) -> None:
    for key, (global_value, local_value) in container.scaled_attributes.items():
        setattr(module, key, local_value if local else global_value)


def install_container(
    module: nn.Module, container: ShardedContainer, plan: ParallelPlan, tp_mesh: DeviceMesh
) -> list[RemovableHandle]:
    entries = [module.get_submodule(suffix) for suffix in container.entry_suffixes]
    narrow = container.hidden_size // plan.tensor_parallel if container.narrow_input else None
    return install_container_hooks(module, entries, tp_mesh, plan.sequence_parallel, narrow)


def apply_tensor_parallel(model: nn.Module, plan: ParallelPlan, tp_mesh: DeviceMesh) -> list[RemovableHandle]:
    """Shard ``model`` according to ``plan``; returns the hooks it installed."""
    if plan.is_empty:
        return []
    aliases = _parameter_aliases(model)
    for container in plan.containers:
        scale_attributes(model.get_submodule(container.name), container, local=True)
    # Parameters were made identical on every rank before this call, so each rank can take its
    # shard locally (src_data_rank=None) instead of scattering from rank 0.
    parallelize_module(model, tp_mesh, plan.styles, src_data_rank=None)
    _retie(aliases)
    handles: list[RemovableHandle] = []
    for container in plan.containers:
        handles += install_container(model.get_submodule(container.name), container, plan, tp_mesh)
    if plan.sequence_parallel and plan.block_names:
        first, last = model.get_submodule(plan.block_names[0]), model.get_submodule(plan.block_names[-1])
        handles += install_sequence_region(first, last, tp_mesh)
    log.info(
        "applied tensor parallelism (tp=%d, sp=%s) to %d modules",
        plan.tensor_parallel,
        plan.sequence_parallel,
        len(plan.styles),
    )
    return handles
