"""Apply the tensor/sequence-parallel part of a ``ParallelPlan`` to a model, in place."""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.hooks import RemovableHandle

from lightning_parallel.tensor_parallel.plan import ParallelPlan, ShardedContainer
from lightning_parallel.tensor_parallel.regions import (
    install_block_argument_slices,
    install_container_hooks,
    install_sequence_region,
    install_whole_sequence,
)
from lightning_parallel.tensor_parallel.row_layout import record_row_layouts


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


def scale_attributes(module: nn.Module, container: ShardedContainer, *, local: bool) -> None:
    """Set the container's head counts and widths to the local shard's (``local``) or back to the model's.

    ``config.<name>`` is a head count the module reads from its config while it runs: the module gets a
    copy of the config of its own, so the rest of the model (embeddings, other modules) keeps the model's.
    """
    for key, (global_value, local_value) in container.scaled_attributes.items():
        target = module
        if key.startswith("config."):
            if not getattr(module, "_lp_own_config", False):
                module.config = copy.copy(module.config)
                module._lp_own_config = True
            target, key = module.config, key[len("config.") :]
        setattr(target, key, local_value if local else global_value)


def install_container(
    module: nn.Module, container: ShardedContainer, plan: ParallelPlan, tp_mesh: DeviceMesh
) -> list[RemovableHandle]:
    entries = [module.get_submodule(suffix) for suffix in container.entry_suffixes]
    narrow = container.hidden_size // plan.tensor_parallel if container.narrow_input else None
    heads = container.heads if container.slice_heads else None
    is_block = container.name in plan.block_names
    handles = install_container_hooks(
        module,
        entries,
        tp_mesh,
        sequence_parallel=plan.sequence_parallel,
        narrow_width=narrow,
        slice_heads=heads,
        is_block=is_block,
    )
    if container.copy_output:  # torch's local output is a view its autograd forbids changing in place
        exit_module = module.get_submodule(
            container.exit[len(container.name) + 1 :] if container.name else container.exit
        )
        handles.append(exit_module.register_forward_hook(_copy))
    if container.copy_entry_outputs:  # OLMo clamps q, k and v in place (OLMoE: after its q/k norms)
        norms = [sub for name, sub in module.named_modules() if name and "norm" in type(sub).__name__.lower()]
        handles += [sub.register_forward_hook(_copy) for sub in [*entries, *norms]]
    return handles


def _copy(module: nn.Module, args: Any, output: Any) -> Any:
    return output.clone() if isinstance(output, torch.Tensor) else output


def _to_parameter_layout(param: torch.Tensor) -> None:
    grad = param.grad
    if not (isinstance(grad, DTensor) and isinstance(param, DTensor)) or grad.placements == param.placements:
        return
    # Only replicated to sharded, a local slice: a pending sum (Partial, the norms under sequence parallelism)
    # is the gradient reductions' to make, once per step with the others (parallelize/gradients.py).
    if all(isinstance(p, Replicate) for p in grad.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def keep_gradients_in_parameter_layout(model: nn.Module) -> list[RemovableHandle]:
    """Give every sharded weight its gradient in the weight's own placements.

    DTensor's sharding rule for the embedding's backward computes a vocabulary-parallel (``Shard(0)``)
    weight's gradient replicated: every rank held the whole ``vocab x hidden`` gradient, and the
    optimizer built its states from it at full size too (found by the planner's exactness test:
    gradient and momentum bytes above the parameter's on every rank of tensor-parallel Llama).
    Replicated to sharded is a local slice, no communication; nothing else is touched.
    """
    return [
        param.register_post_accumulate_grad_hook(_to_parameter_layout)
        for param in model.parameters()
        if isinstance(param, DTensor)
    ]


def apply_tensor_parallel(model: nn.Module, plan: ParallelPlan, tp_mesh: DeviceMesh) -> list[RemovableHandle]:
    """Shard ``model`` according to ``plan``; returns the hooks it installed.

    The one sharding order: the model's plan, and each block's relative plan in the verification
    (``tensor_parallel/verify.py``: the block is then its own block stack, named ``""``), run through here.
    """
    aliases = _parameter_aliases(model)
    for container in plan.containers:
        scale_attributes(model.get_submodule(container.name), container, local=True)
    # Parameters were made identical on every rank before this call, so each rank can take its
    # shard locally (src_data_rank=None) instead of scattering from rank 0.
    parallelize_module(
        model, tp_mesh, {name: style for name, style in plan.styles.items() if name}, src_data_rank=None
    )
    # a verified block's own style (named ""): torch's plan dict names children only
    if (own := plan.styles.get("")) is not None:
        parallelize_module(model, tp_mesh, own, src_data_rank=None)
    _retie(aliases)
    record_row_layouts(model)
    handles: list[RemovableHandle] = keep_gradients_in_parameter_layout(model)
    for container in plan.containers:
        handles += install_container(model.get_submodule(container.name), container, plan, tp_mesh)
    if plan.sequence_parallel and plan.block_names:
        first, last = model.get_submodule(plan.block_names[0]), model.get_submodule(plan.block_names[-1])
        handles += install_sequence_region(first, last, tp_mesh)
        for name in plan.block_names:  # after the region's entry: the hidden state is cut already
            handles += install_block_argument_slices(model.get_submodule(name), tp_mesh)
    for name in plan.whole_sequence if plan.sequence_parallel else []:
        handles += install_whole_sequence(model.get_submodule(name), tp_mesh)
    return handles
