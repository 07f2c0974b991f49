"""The record of every private torch and Lightning API ``compat.py`` reaches: where the package uses it, through
which of compat's names, the versions it was read or run on, and how they differ.

Data, kept apart from compat's code so that each reads on its own: the next upgrade reads this list against the
new release, then compat's version gates where an entry says the versions differ. ``tests/test_compat.py``
resolves every entry on the installed versions and fails on a private import outside compat.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LIGHTNING_CHECKED", "PRIVATE_APIS", "TORCH_CHECKED", "TORCH_VERSION", "PrivateApi"]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _version(torch.__version__)  # (major, minor) of the installed torch

TORCH_CHECKED = ("2.11.0", "2.13.0")
LIGHTNING_CHECKED = ("2.6.6",)  # with both torch versions


@dataclass(frozen=True)
class PrivateApi:
    """A private API the package uses: ``name`` as its library spells it (``module:attribute.path``)."""

    name: str
    used_by: str  # the project modules, through the helper named in ``via``
    via: str  # the name in compat.py the package uses instead
    checked: tuple[str, ...] = TORCH_CHECKED  # the versions it was read or run on
    note: str = ""  # how the versions differ, or why the private API is needed
    resolvable: bool = True  # False: an instance attribute, not resolvable from the module


_LT = LIGHTNING_CHECKED
PRIVATE_APIS: tuple[PrivateApi, ...] = (
    # ---- tensor parallelism and DTensor
    PrivateApi(
        "torch.distributed.tensor.placement_types:_StridedShard",
        "tensor_parallel/styles.py, precision/grad_norm.py, checkpoint/layouts.py, zero/fsdp.py",
        "StridedShard",
        note="2.11 cannot run it through F.linear (aten.t) or redistribute it: strided_shard_in_ops",
    ),
    PrivateApi(
        "torch.distributed.tensor.parallel.style:ParallelStyle._apply",
        "tensor_parallel/styles.py, norm_styles.py",
        "(overridden)",
        note="with ColwiseParallel/RowwiseParallel._prepare_input_fn"
        " and _prepare_output_fn, static, same argument order on both",
    ),
    PrivateApi(
        "torch.distributed.device_mesh:DeviceMesh._flatten",
        "mesh/parallel_dims.py, zero/groups.py",
        "flatten_mesh",
        note="2.11 cannot slice a flattened axis of non-adjacent axes (NotImplementedError);"
        " _flatten returns the mesh it made before",
    ),
    PrivateApi("torch.utils._pytree:tree_map", "tensor_parallel/verify.py, loss_parallel.py", "tree_map"),
    PrivateApi(
        "torch.utils._pytree:tree_map_only",
        "context_parallel/, pipeline/discover.py, runner.py",
        "tree_map_only",
    ),
    PrivateApi(
        "torch.utils._python_dispatch:is_traceable_wrapper_subclass",
        "memory/counting.py",
        "is_traceable_wrapper_subclass",
        note="__tensor_flatten__ lists one more name on 2.13; index 0 read",
    ),
    PrivateApi(
        "torch.utils._python_dispatch:TorchDispatchMode", "memory/checkpointing.py", "TorchDispatchMode"
    ),
    PrivateApi(
        "torch.utils.checkpoint:SelectiveCheckpointContext.__init__",
        "memory/checkpointing.py",
        "selective_policy_sees_output",
        note="op_output only on 2.13 (policy after the op)",
    ),
    # ---- FSDP2 and replicate
    # ---- the dispatcher (autocast's rule for grouped matmuls)
    PrivateApi(
        "torch._C:_ExcludeDispatchKeyGuard",
        "precision/grouped_mm_autocast.py",
        "below_dispatch_key",
        note="with torch._C.DispatchKeySet and DispatchKey; torch.library.register_autocast uses the same",
    ),
    PrivateApi(
        "torch._C:_dispatch_has_kernel_for_dispatch_key",
        "precision/grouped_mm_autocast.py",
        "has_kernel_for",
        note="neither release has an autocast kernel for aten::_grouped_mm",
    ),
    PrivateApi("torch.library:Library._destroy", "precision/grouped_mm_autocast.py", "destroy_library"),
    PrivateApi("torch.distributed.fsdp:FSDPModule._get_fsdp_state", "zero/fsdp.py", "fsdp_state"),
    PrivateApi(
        "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._fsdp_param_groups",
        "zero/fsdp.py",
        "fsdp_param_groups",
        note="2.13 only; 2.11 has the singular _fsdp_param_group",
        resolvable=False,
    ),
    PrivateApi(
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.to_accumulated_grad_if_needed",
        "zero/fsdp.py (zero_gather_dtype='compute')",
        "fsdp_accumulate_in_reduce_dtype",
        note="with FSDPParamGroup.reduce_grads, FSDPParam.unsharded_accumulated_grad and ._unsharded_param; the"
        " post-backward wrapped per group: alike in both releases",
    ),
    PrivateApi(
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.grad_offload_event",
        "zero/overlapped_step.py (through zero/fsdp.py: shard_states)",
        "fsdp_grad_copy_event",
        note="2.11 leaves the copy to pinned host memory in flight when post-accumulate-grad hooks read the"
        " gradient (set here, waited for at the end of backward); 2.13 copies synchronously then",
        resolvable=False,
    ),
    PrivateApi(
        "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._post_forward",
        "zero/fsdp_schedule.py",
        "fsdp_close_forward",
        note="with ._training_state",
    ),
    PrivateApi(
        "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._root_post_backward_final_callback",
        "zero/fsdp_schedule.py",
        "fsdp_root_callback",
        note="with ._is_root, read by fsdp_post_backward",
    ),
    PrivateApi(
        "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup.post_backward",
        "zero/fsdp_schedule.py",
        "fsdp_post_backward",
        note="with .fsdp_params, FSDPParam.sharded_param and .unsharded_param (zero/fsdp.py)",
    ),
    PrivateApi(
        "torch.distributed.fsdp._fully_shard._fsdp_common:TrainingState",
        "zero/fsdp_schedule.py",
        "fsdp_in_forward",
    ),
    PrivateApi(
        "torch.distributed._composable.replicate_with_fsdp:replicate",
        "data_parallel/replicate.py",
        "fsdp_replicate",
        note="2.13 adds dp_mesh_dims= (unused)",
    ),
    PrivateApi(
        "torch.distributed._composable.replicate:replicate", "data_parallel/replicate.py", "ddp_replicate"
    ),
    # ---- pipelining
    PrivateApi(
        "torch.distributed.pipelining.stage:_PipelineStageBase._get_init_p2p_neighbors_ops",
        "pipeline/last_backward.py",
        "without_sends_to_self",
        note="(overridden) 2.11 calls it before each"
        " schedule's first step and pairs a stage with a neighbour on its own rank (V schedules), which"
        " gloo refuses; 2.13 warms up by a vote and calls it only for stages not PipelineStage",
    ),
    PrivateApi(
        "torch.distributed.pipelining.stage:PipelineStage._shape_inference",
        "pipeline/last_backward.py",
        "(overridden)",
        ("2.11.0",),
        note="2.11 only (an extra forward before the first step), run"
        " under fork_rng; 2.13 infers metadata otherwise",
        resolvable=TORCH_VERSION < (2, 13),
    ),
    PrivateApi(
        "torch.distributed.pipelining.stage:_make_tensor_from_meta",
        "pipeline/receive_buffers.py",
        "(swapped while a stage prepares)",
        note="the factory of every receive buffer on both (2.13 imports"
        " it from _utils); placeholders instead, a pooled buffer per receive posted",
    ),
    PrivateApi(
        "torch.distributed.pipelining.stage:_PipelineStageBase._prepare_forward_infra",
        "pipeline/last_backward.py",
        "(overridden)",
        note="where receive buffers are made, on both",
    ),
    PrivateApi(
        "torch.distributed.pipelining.stage:_PipelineStageBase._prepare_backward_infra",
        "pipeline/last_backward.py",
        "(overridden)",
        note="where gradient receive buffers are made, on both",
    ),
    PrivateApi(
        "torch.distributed.pipelining.schedules:_PipelineScheduleRuntime.pipeline_order_with_comms",
        "pipeline/receive_buffers.py",
        "(read)",
        note="the planner counts receive buffers on torch's own"
        " action lists (built with stand-in stages); an estimate where that fails",
        resolvable=False,
    ),
    PrivateApi(
        "torch.distributed.pipelining._backward:stage_backward_weight",
        "pipeline/split_backward.py",
        "split_weight_backward_exact",
        note="2.11 hands each intermediate the sum of its output gradients on output 0 and starts from every"
        " intermediate of a group: wrong weight gradients for a group of several intermediates on one path or an"
        " intermediate of several outputs (measured); 2.13 exact. Not called by the package, gated",
    ),
    PrivateApi(
        "torch.distributed.pipelining._backward:get_param_groups",
        "pipeline/split_backward.py",
        "pipeline_weight_groups",
        note="with construct_reverse_graph and _get_grad_fn_or_grad_acc; same on both; Node._input_metadata"
        " read for the number of a node's outputs",
    ),
    PrivateApi(
        "torch.distributed.pipelining.schedules:_batch_p2p",
        "pipeline/send_release.py",
        "(wrapped while a step runs)",
        note="feature-detected: absent, a step's sends stay until its end as torch keeps them; run on both (the"
        " pipeline parity files on 2.11 over gloo): 2.11 batches a step's sends in one batch_isend_irecv (one"
        " Work per batch), 2.13 one Work per send; the wrapper releases either",
    ),
    # ---- collectives, checkpoints, build
    PrivateApi("torch.distributed.utils:_sync_module_states", "parallelize/recipe.py", "sync_module_states"),
    PrivateApi(
        "torch.distributed.distributed_c10d:_get_default_store", "launch/interrupt.py", "default_store"
    ),
    PrivateApi(
        "torch._utils:_flatten_dense_tensors", "data_parallel/gradient_sync.py", "flatten_dense_tensors"
    ),
    PrivateApi(
        "torch._utils:_unflatten_dense_tensors", "data_parallel/gradient_sync.py", "unflatten_dense_tensors"
    ),
    PrivateApi(
        "torch.distributed.algorithms.ddp_comm_hooks.default_hooks:_compress_hook",
        "comm/compression.py",
        "compress_hook",
    ),
    PrivateApi(
        "torch.distributed.checkpoint.state_dict_loader:_load_state_dict",
        "checkpoint/transfer.py",
        "read_checkpoint_entries",
        note="with format_utils._EmptyStateDictLoadPlanner(keys=)",
    ),
    PrivateApi(
        "torch.distributed.checkpoint.format_utils:_EmptyStateDictLoadPlanner",
        "checkpoint/transfer.py",
        "read_checkpoint_entries",
    ),
    PrivateApi(
        "torch.utils.cpp_extension:_get_build_directory", "zero/deepspeed_ops.py", "extension_build_directory"
    ),
    # ---- kernels (C-level names with an underscore, called as torch's own code calls them)
    PrivateApi(
        "torch:_grouped_mm", "experts/experts.py", "grouped_mm", note="F.grouped_mm first where present"
    ),
    PrivateApi("torch:_foreach_norm", "precision/grad_norm.py", "(called)", note="dtype= on both"),
    PrivateApi("torch:_foreach_mul_", "precision/grad_norm.py", "(called)"),
    PrivateApi("torch:_amp_foreach_non_finite_check_and_unscale_", "precision/loss_scaler.py", "(called)"),
    PrivateApi(
        "torch.amp:GradScaler._unscale_grads_",
        "precision/loss_scaler.py",
        "(overridden)",
        note="with _check_inf_per_device, _per_optimizer_states, _device; _get_scale_async in"
        " strategy/pipelined.py",
    ),
    # ---- Lightning
    PrivateApi(
        "lightning.fabric.utilities.load:_METADATA_FILENAME",
        "checkpoint/atomic.py, transfer.py, strategy/checkpointing.py",
        "METADATA_FILENAME",
        _LT,
    ),
    PrivateApi(
        "lightning.fabric.strategies.fsdp:_distributed_checkpoint_load",
        "checkpoint/zero.py, strategy/checkpointing.py",
        "distributed_checkpoint_load",
        _LT,
    ),
    PrivateApi(
        "lightning.fabric.strategies.model_parallel:_distributed_checkpoint_save",
        "strategy/checkpointing.py",
        "distributed_checkpoint_save",
        _LT,
    ),
    PrivateApi(
        "lightning.fabric.strategies.model_parallel:_is_full_checkpoint",
        "strategy/checkpointing.py",
        "is_full_checkpoint",
        _LT,
    ),
    PrivateApi(
        "lightning.fabric.strategies.model_parallel:_is_sharded_checkpoint",
        "strategy/checkpointing.py",
        "is_sharded_checkpoint",
        _LT,
    ),
    PrivateApi(
        "lightning.fabric.strategies.model_parallel:_rekey_optimizer_state_if_needed",
        "strategy/checkpointing.py",
        "rekey_optimizer_state_if_needed",
        _LT,
    ),
    PrivateApi(
        "lightning.fabric.utilities.seed:_collect_rng_states",
        "strategy/checkpointing.py",
        "collect_rng_states",
        _LT,
    ),
    PrivateApi(
        "lightning.fabric.utilities.seed:_set_rng_states", "strategy/checkpointing.py", "set_rng_states", _LT
    ),
    PrivateApi(
        "lightning.pytorch.strategies.model_parallel:_align_compiled_param_names_with_module",
        "strategy/checkpointing.py",
        "align_compiled_param_names_with_module",
        _LT,
    ),
    PrivateApi(
        "lightning.fabric.utilities.distributed:_init_dist_connection",
        "strategy/base.py",
        "init_dist_connection",
        _LT,
    ),
    PrivateApi(
        "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector.hpc_save_path",
        "launch/slurm.py",
        "hpc_save_path",
        _LT,
    ),
    PrivateApi(
        "lightning.pytorch.trainer.trainer:Trainer._accelerator_connector",
        "launch/slurm.py",
        "cluster_environment",
        _LT,
        resolvable=False,
    ),
)
