"""Every private torch and Lightning API this package leans on, in one place.

torch's and Lightning's private modules and attributes change between releases without notice. Each
one the package uses is imported or read here, and :data:`PRIVATE_APIS` (``compat_record.py``, the data
beside this code) records where it is used, the versions it was checked on and how they differ; where
they do, a version gate or a feature check below picks the right path. The next upgrade reads the
record, then this file. ``tests/test_compat.py`` resolves the entries on the installed versions and
fails when a private torch or Lightning import appears anywhere else in the package. Heavy or rarely needed
modules (DCP's loader, Lightning's strategies) are imported where used.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map, tree_map_only
from torch.utils.checkpoint import SelectiveCheckpointContext

from lightning_parallel.compat_record import (
    LIGHTNING_CHECKED,
    PRIVATE_APIS,
    TORCH_CHECKED,
    TORCH_VERSION,
    PrivateApi,
)

__all__ = [
    "FUSED_AS_ROWS_ENV",
    "LIGHTNING_CHECKED",
    "METADATA_FILENAME",
    "PRIVATE_APIS",
    "PrivateApi",
    "StridedShard",
    "TORCH_CHECKED",
    "TORCH_VERSION",
    "TorchDispatchMode",
    "align_compiled_param_names_with_module",
    "cluster_environment",
    "collect_rng_states",
    "compress_hook",
    "below_dispatch_key",
    "ddp_replicate",
    "default_store",
    "destroy_library",
    "distributed_checkpoint_load",
    "distributed_checkpoint_save",
    "extension_build_directory",
    "flatten_dense_tensors",
    "flatten_mesh",
    "fsdp_accumulate_in_reduce_dtype",
    "fsdp_close_forward",
    "fsdp_grad_copy_event",
    "fsdp_in_forward",
    "fsdp_param_groups",
    "fsdp_post_backward",
    "fsdp_replicate",
    "fsdp_root_callback",
    "fsdp_state",
    "grouped_mm",
    "has_kernel_for",
    "hpc_save_path",
    "init_dist_connection",
    "is_full_checkpoint",
    "is_sharded_checkpoint",
    "is_traceable_wrapper_subclass",
    "read_checkpoint_entries",
    "rekey_optimizer_state_if_needed",
    "selective_policy_sees_output",
    "set_rng_states",
    "strided_shard_in_ops",
    "pipeline_weight_groups",
    "split_weight_backward_exact",
    "sync_module_states",
    "tree_map",
    "tree_map_only",
    "unflatten_dense_tensors",
    "without_sends_to_self",
]


# ---- version gates -------------------------------------------------------------------------------

FUSED_AS_ROWS_ENV = "LP_FUSED_AS_ROWS"
"""Set to ``1`` to store fused projections as row layouts on any torch (the tests run torch 2.11's path on 2.13)."""


def strided_shard_in_ops() -> bool:
    """Whether fused projections may be ``_StridedShard(dim, split_factor=k)`` (``tensor_parallel/styles.py``).

    torch 2.11's sharding rule for ``aten.t`` leaves ``_StridedShard(0)`` on dim 0 of the transposed weight
    inside ``F.linear``, and its redistribute plans every ``_StridedShard`` with the graph planner, which
    raises ``unable to be interpreted into a corresponding shard_order`` for a split factor that is not a
    product of mesh sizes (2 or 3 on the 1-D ``tp`` mesh). 2.13 fixes both (it falls back to the greedy
    planner). Checked: 2.11.0 (broken), 2.13.0 (works).
    """
    return TORCH_VERSION >= (2, 13) and os.environ.get(FUSED_AS_ROWS_ENV, "") != "1"


def selective_policy_sees_output() -> bool:
    """Whether selective checkpointing's policy is called after the op with ``ctx.op_output`` (torch 2.13).

    torch 2.11 calls it before the op (no ``op_output``), and again while recomputing with
    ``is_recompute=True``; ``memory/checkpointing.py`` then counts the kept outputs with a dispatch mode.
    Checked: 2.11.0 (no), 2.13.0 (yes).
    """
    return "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


def pipeline_weight_groups(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor]
) -> list[tuple[list[torch.Tensor], list[int]]]:
    """torch's split-backward grouping (``pipelining._backward.get_param_groups``) of the graph behind ``outputs``:
    per group, its weights (the graph's leaves other than ``inputs``) and, for each of its intermediate nodes
    (where the weights' paths meet the activations'), how many outputs that node has. The same on 2.11 and 2.13."""
    import torch.distributed.pipelining._backward as _backward

    roots = [node for t in outputs if (node := _backward._get_grad_fn_or_grad_acc(t)) is not None]
    reverse = _backward.construct_reverse_graph(roots)
    input_ids = {id(t) for t in inputs}
    input_nodes = [
        node for t in inputs if t.requires_grad and (node := _backward._get_grad_fn_or_grad_acc(t))
    ]
    weight_nodes = [
        node for node in reverse if hasattr(node, "variable") and id(node.variable) not in input_ids
    ]  # AccumulateGrad: the leaves
    groups = _backward.get_param_groups(input_nodes, weight_nodes, reverse)
    return [
        (
            [node.variable for node in group["params"]],
            [len(node._input_metadata) for node in group["intermediates"]],
        )
        for group in groups
    ]


def split_weight_backward_exact() -> bool:
    """Whether the pipeline's split weight pass (``pipelining._backward.stage_backward_weight``, the zero-bubble
    schedules) matches the full backward where a stage uses a parameter more than once.

    torch 2.11 hands the gradients reaching a node where parameters meet activations to that node as one sum
    (wrong weight gradients for a parameter with several consumers, ``pipeline/split_backward.py``); 2.13 hands
    one per output. Checked: 2.11.0 (wrong, measured), 2.13.0 (exact).
    """
    return TORCH_VERSION >= (2, 13)


# ---- torch ---------------------------------------------------------------------------------------

StridedShard = _StridedShard
"""Each rank's slice of every one of ``split_factor`` equal parts (fused projections on torch >= 2.13)."""

grouped_mm: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)
"""One matmul per group of rows (``offs=``), or None where torch has neither name."""


def flatten_dense_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors copied into one flat buffer (DDP's bucket)."""
    return torch._utils._flatten_dense_tensors(tensors)


def unflatten_dense_tensors(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``like``."""
    return list(torch._utils._unflatten_dense_tensors(flat, like))


def flatten_mesh(mesh: Any, axes: tuple[str, ...], name: str) -> Any:
    """The axes ``axes`` of ``mesh`` as one axis called ``name`` (made once; later calls return it)."""
    return mesh[axes]._flatten(name)


def fsdp_state(unit: Any) -> Any:
    """The ``FSDPState`` of an FSDP2 unit (``fully_shard``'s module)."""
    return unit._get_fsdp_state()


def fsdp_param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup``\\ s of an FSDP2 state.

    torch 2.13 keeps a list, ``_fsdp_param_groups``; 2.11 has one optional group, ``_fsdp_param_group``
    (2.13 keeps that name as a property that raises when there is more than one group).
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def fsdp_accumulate_in_reduce_dtype(unit: Any) -> None:
    """FSDP2 with ``reduce_dtype`` other than ``param_dtype``: a backward that does not reduce moves 16-bit gradients
    into fp32 accumulators; a first gradient in the reducing backward comes 16-bit beside them, which the reduce-scatter
    refuses (2.11, 2.13). It is moved to fp32 first, as FSDP2 moves the others (the reduce-scatter casts so anyway)."""
    for group in fsdp_param_groups(fsdp_state(unit)):

        def post_backward(*args: Any, group: Any = group, original: Any = group.post_backward) -> Any:
            params = group.fsdp_params
            if group.reduce_grads and any(p.unsharded_accumulated_grad is not None for p in params):
                for param in params:
                    if param.unsharded_accumulated_grad is None and hasattr(param, "_unsharded_param"):
                        param.to_accumulated_grad_if_needed()
            return original(*args)

        group.post_backward = post_backward


def fsdp_grad_copy_event(fsdp_param: Any) -> Any:
    """The event of an ``FSDPParam``'s gradient copy to pinned host memory while it may still be in flight, or None.

    torch 2.11 copies an offloaded shard's reduced gradient with ``non_blocking=True`` (pinned memory, CUDA) even
    when post-accumulate-grad hooks will read it at once, and waits for this event only at the end of backward;
    torch 2.13 copies synchronously when such hooks exist (and then records none).
    """
    return getattr(fsdp_param, "grad_offload_event", None)


def fsdp_in_forward(unit: Any) -> bool:
    """Whether the unit's forward began and its post-forward has not run."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return fsdp_state(unit)._training_state == TrainingState.FORWARD


def fsdp_close_forward(unit: Any, output: torch.Tensor) -> None:
    """Run the unit's post-forward on ``output`` (resharding, and the pre-backward hooks on ``output``)."""
    fsdp_state(unit)._post_forward(unit, (), output)


def fsdp_post_backward(unit: Any) -> bool:
    """The post-backward of each of the unit's parameter groups (the reduce-scatter of what its hooks left),
    for a unit a pipeline stage drove itself; returns whether it is a root (see :func:`fsdp_root_callback`)."""
    state = fsdp_state(unit)
    for group in fsdp_param_groups(state):
        group.post_backward()
    return bool(state._is_root)


def fsdp_root_callback(unit: Any) -> None:
    """A root unit's end of backward: wait for the reductions (FSDP2 queues it on autograd's engine)."""
    fsdp_state(unit)._root_post_backward_final_callback()


def below_dispatch_key(key: str) -> Any:
    """A context in which the dispatcher skips ``key`` (``"AutocastCPU"``): a kernel registered there redispatches."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key)))


def has_kernel_for(op: str, key: str) -> bool:
    """Whether ``op`` (``"aten::_grouped_mm"``) has a kernel of its own at dispatch key ``key``."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, key))


def destroy_library(library: torch.library.Library) -> None:
    """Remove every kernel ``library`` registered (torch keeps them for the process otherwise)."""
    library._destroy()


def without_sends_to_self(ops: list[Any]) -> list[Any]:
    """The ``dist.P2POp`` objects of ``ops`` whose peer is another rank (gloo has no pair to itself)."""

    return [op for op in ops if op.group_peer != dist.get_rank(op.group)]


def fsdp_replicate() -> Callable[..., Any]:
    """FSDP2's ``replicate`` (DTensor parameters replicated over a mesh)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


def ddp_replicate() -> Callable[..., Any]:
    """DDP's reducer applied in place (``replicate(module, process_group=...)``)."""
    from torch.distributed._composable.replicate import replicate

    return replicate


def sync_module_states(module: torch.nn.Module, group: Any, src: int = 0) -> None:
    """Broadcast parameters and buffers from ``src`` (as DDP does at construction), in 250 MB buckets."""
    from torch.distributed.utils import _sync_module_states

    _sync_module_states(module, group, 250 * 1024 * 1024, src, set())


def default_store() -> Any:
    """The default process group's key-value store."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def compress_hook(dtype: torch.dtype, group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """torch's DDP compress hook: the mean computed in ``dtype``, the result cast back in place."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(dtype, group, bucket)


def read_checkpoint_entries(checkpoint: Path, keys: set[str]) -> dict[str, Any]:
    """The top-level ``keys`` of a sharded checkpoint folder, whole, without a process group (as torch's own
    ``dcp_to_torch_save`` reads all of them)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=FileSystemReader(checkpoint),
        planner=_EmptyStateDictLoadPlanner(keys=keys),
        no_dist=True,
    )
    return state


def extension_build_directory(name: str) -> Path:
    """Where torch builds (or finds) the C++ extension ``name``."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


# ---- Lightning -----------------------------------------------------------------------------------

METADATA_FILENAME: str = _METADATA_FILENAME
"""The file of a sharded checkpoint folder Lightning writes last (``lightning.fabric.utilities.load``)."""


def distributed_checkpoint_load(state: dict[str, Any], path: Path) -> None:
    """Lightning's DCP load into ``state`` (in place)."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load

    _distributed_checkpoint_load(state, path)


def hpc_save_path(root_dir: str) -> str:
    """Lightning's next ``hpc_ckpt_<n>.ckpt`` under ``root_dir`` (what its SLURM requeue resumes from)."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    return _CheckpointConnector.hpc_save_path(root_dir)


def cluster_environment(trainer: Any) -> Any:
    """The Trainer's cluster environment (SLURM, torchrun, ...)."""
    return trainer._accelerator_connector.cluster_environment


def _lightning(module: str, name: str) -> Any:

    return getattr(importlib.import_module(module), name)


def distributed_checkpoint_save(state: dict[str, Any], path: Path) -> None:
    """Lightning's DCP save of ``state`` into the folder ``path``."""
    _lightning("lightning.fabric.strategies.model_parallel", "_distributed_checkpoint_save")(state, path)


def is_sharded_checkpoint(path: Path) -> bool:
    return bool(_lightning("lightning.fabric.strategies.model_parallel", "_is_sharded_checkpoint")(path))


def is_full_checkpoint(path: Path) -> bool:
    return bool(_lightning("lightning.fabric.strategies.model_parallel", "_is_full_checkpoint")(path))


def rekey_optimizer_state_if_needed(state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """An optimizer state keyed by parameter ids, keyed by names (as Lightning's ModelParallelStrategy loads)."""
    rekey = _lightning("lightning.fabric.strategies.model_parallel", "_rekey_optimizer_state_if_needed")
    return rekey(state, module)


def collect_rng_states() -> dict[str, Any]:
    return _lightning("lightning.fabric.utilities.seed", "_collect_rng_states")()


def set_rng_states(states: dict[str, Any]) -> None:
    _lightning("lightning.fabric.utilities.seed", "_set_rng_states")(states)


def align_compiled_param_names_with_module(state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """A state dict of a compiled module (``_orig_mod.`` names) under the module's own names."""
    name = "_align_compiled_param_names_with_module"
    return _lightning("lightning.pytorch.strategies.model_parallel", name)(state, module)


def init_dist_connection(*args: Any, **kwargs: Any) -> None:
    """Lightning's process-group start (``cluster_environment, backend, global_rank, world_size, timeout=``)."""
    _lightning("lightning.fabric.utilities.distributed", "_init_dist_connection")(*args, **kwargs)
