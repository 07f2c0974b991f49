"""The ordered recipe: how an unchanged module becomes this rank's part of a parallel job.

:func:`parallelize` reads top to bottom, as torchtitan's ``parallelize_llama`` does: each line is
one step with explicit arguments (the step modules beside this one), in the order they must
happen. The strategy calls it from ``setup`` and keeps the :class:`Parallelized` it returns.

Order, and why:

1. the tensor-parallel plan (pure: a model that cannot be sharded fails on every rank alike);
2. every rank starts from rank 0's weights (as DDP does);
3. one run of the user's step on a real batch, watched by the pipeline discovery and the plan
   verification's capture of each block's inputs (both need the whole, unsharded model);
4. the plan verified on one block of each class (refused before anything is changed), and the
   context split likewise;
5. the pipeline cut (before sharding: other stages' blocks are freed, not sharded);
6. experts sharded over ``ep``; the context split's entering hooks (after the pipeline's
   injection of received activations, before sequence parallelism's own split);
7. tensor/sequence parallelism on what this rank keeps; the context split's gather after it;
8. ZeRO on FSDP2 where ``zero/engine_choice.py`` picks it: ``fully_shard`` over ``dp``
   (``zero_sharding.py``), before the stages capture the parameters; then the pipeline's stages and
   schedule (on the sharded modules);
9. activation checkpointing and the saved-tensor saver (on the sharded, cut modules);
10. ``compile`` of each block (after sharding, before data-parallel wrapping);
11. every gradient reduction: data parallelism or ZeRO's preparation (``gradients.py``), as
    ``reductions.py`` decided them.

The strategy then loads ``init_weights`` (each rank its own part), creates the optimizers and,
under ZeRO, hands both to DeepSpeed's engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_parallel.compat import sync_module_states
from lightning_parallel.config import ParallelConfig
from lightning_parallel.mesh import Axis, ParallelDims
from lightning_parallel.parallelize import context_parallel_step, pipeline_step, tensor_parallel_step
from lightning_parallel.parallelize.experts_step import ExpertState, apply_experts, expert_parameter_ids
from lightning_parallel.parallelize.gradients import plan_gradient_reductions
from lightning_parallel.parallelize.memory_step import apply_memory_savers
from lightning_parallel.parallelize.result import Parallelized
from lightning_parallel.parallelize.sample import SampledStep, StepProbe
from lightning_parallel.parallelize.zero_sharding import shard_for_zero
from lightning_parallel.pipeline.microbatch import split_batch
from lightning_parallel.pipeline.setup import PipelineConfig
from lightning_parallel.pipeline.stages import SkippedBlock, StageLayout
from lightning_parallel.plans.detect import block_names
from lightning_parallel.tensor_parallel import BlockInputCapture, ParallelPlan, capture_block_inputs
from lightning_parallel.tensor_parallel.block_kinds import first_block_of_each_kind
from lightning_parallel.tensor_parallel.captured_inputs import Captured
from lightning_parallel.tensor_parallel.loss_parallel import LossParallelState
from lightning_parallel.zero.engine_choice import config_engine
from lightning_parallel.zero.fsdp_schedule import before_schedule


def parallelize(
    module: nn.Module,
    config: ParallelConfig,
    dims: ParallelDims,
    sample: Callable[[], SampledStep | None],
    *,
    device: torch.device,
    training: bool,
    gather_dtype: torch.dtype | None = None,
) -> Parallelized:
    """Apply the layout ``dims`` (its mesh built) to ``module``, in place; every rank calls it alike.

    ``sample``: makes the user's step on the first batch, called at most once and only when a step
    needs it (None: no data; pipelines then refuse, the plan goes unverified with a warning).
    ``training``: ``Trainer.fit`` (the step returns a loss). ``gather_dtype``: ZeRO on FSDP2 gathers the
    parameters in it (``zero/fsdp.py: gather_dtype_for``; None: as stored).
    """
    # the module as given was checked by the strategy (check_module_as_given), before its move to the device
    mesh = dims.mesh
    plan = (
        tensor_parallel_step.build_plan(module, config.tensor, dims.tensor_parallel)
        if dims.tp_enabled
        else None
    )
    blocks = list(plan.block_names) if plan is not None and plan.block_names else block_names(module)
    sync_parameters(module)
    context = (
        context_parallel_step.context_state(
            config.context, mesh, sequence_parallel=plan is not None and plan.sequence_parallel
        )
        if dims.cp_enabled
        else None
    )
    verifies = (plan is not None and config.tensor.verify_plan) or (context is not None and bool(blocks))
    layout, captured = observe_one_step(
        module,
        plan,
        blocks,
        sample,
        pipeline=config.pipeline if dims.pp_enabled else None,
        verifies=verifies,
        training=training,
    )
    if plan is not None and captured is not None and config.tensor.verify_plan:
        tensor_parallel_step.verify_plan(module, plan, mesh[Axis.TP], captured)
    # which engine runs ZeRO (or None): decided once, read by three steps
    engine = config_engine(config, dims)
    if plan is not None:  # every rank alike, before anything is sharded
        tensor_parallel_step.check_row_layouts(plan, engine)
    if context is not None:
        context_parallel_step.verify(module, context, blocks, captured, dims.tensor_parallel)
    cut = pipeline_step.cut_pipeline(module, layout, config.pipeline, mesh) if layout is not None else None
    aux_losses = apply_experts(
        module, config.experts, dims, mesh, sequence_parallel=plan is not None and plan.sequence_parallel
    )
    hooks: list[Any] = []
    # after the pipeline's injection of received activations, before sequence parallelism
    if context is not None:
        hooks += context_parallel_step.enter(module, blocks, context)
    loss_parallel, loss_state = False, LossParallelState()
    if plan is not None:
        tp_hooks, loss_parallel, loss_state = tensor_parallel_step.shard(
            module, plan, config.tensor, mesh[Axis.TP], pipelined=dims.pp_enabled
        )
        hooks += tp_hooks
    context_tokens = None
    if context is not None:  # after the sequence-parallel region's own gather
        cp_hooks, context_tokens = context_parallel_step.leave(module, blocks, context)
        hooks += cp_hooks
    fsdp = shard_for_zero(
        module, config, dims, mesh, blocks, engine=engine, gather_dtype=gather_dtype
    )  # FSDP2: before the stages exist
    # the experts' parameters as the rest holds them: read once, after FSDP2 replaced them (zero/fsdp.py)
    experts = ExpertState(expert_parameter_ids(module, dims), aux_losses)
    runner, norm_exclude = None, set()
    if cut is not None:
        assert config.pipeline is not None
        runner, norm_exclude = pipeline_step.build_runner(
            module,
            cut,
            config.pipeline,
            mesh,
            device,
            experts.aux_losses,
            fsdp.units if fsdp else [],
            fsdp_before_schedule=before_schedule(config.zero.reshard, config.zero.stage) if fsdp else None,
        )
        hooks += cut.runtime.handles
    activation_saver = apply_memory_savers(
        module,
        config.memory,
        blocks,
        plan,
        experts.aux_losses,
        cut.runtime if cut is not None else None,
        stages=cut.layout if cut is not None else None,
        compiled=config.compile,
    )
    if activation_saver is not None:
        hooks += activation_saver.handles
    if config.compile:
        compile_blocks(module, blocks)
    gradients = plan_gradient_reductions(
        module,
        config,
        dims,
        mesh,
        engine=engine,
        runner=runner,
        expert_ids=experts.parameter_ids,
        blocks=blocks,
        fsdp=fsdp,
    )
    hooks += gradients.hooks
    rank_zero_info("Gradient reductions: " + "; ".join(gradients.describe()))
    return Parallelized(
        dims.layout,
        blocks,
        plan=plan,
        pipeline=runner,
        experts=experts,
        context=context,
        context_tokens=context_tokens,
        loss_parallel=loss_parallel,
        loss_state=loss_state,
        activation_saver=activation_saver,
        gradients=gradients,
        norm_exclude=norm_exclude,
        hooks=hooks,
    )


def sync_parameters(module: nn.Module) -> None:
    """Start every rank from rank 0's weights (as DDP does), whatever each rank's init was."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        sync_module_states(module, torch.distributed.group.WORLD, src=0)


def observe_one_step(
    module: nn.Module,
    plan: ParallelPlan | None,
    blocks: list[str],
    make_sample: Callable[[], SampledStep | None],
    *,
    pipeline: PipelineConfig | None,
    verifies: bool,
    training: bool,
) -> tuple[StageLayout | None, dict[str, Captured] | None]:
    """The pipeline's stage layout and the verified blocks' inputs, from one run of the user's step.

    ``pipeline``: the stages to discover (None: not pipelined). ``verifies``: capture the inputs of one block of
    each kind, on which the tensor-parallel plan and the context split are verified. ``training``: the step
    returns a loss (``Trainer.fit``).
    """
    sample = make_sample() if pipeline is not None or verifies else None
    probes: list[StepProbe] = []
    discovery = None
    stage_split = None
    if pipeline is not None:
        if sample is None:
            raise ValueError(pipeline_step.NO_DATA)
        stage_split, discovery = pipeline_step.discovery_probe(
            module, pipeline, sample.batch, training=training
        )
        probes.append(discovery)
        if training:  # the stages run micro-batches: watch one (the whole batch's activations may not fit)
            sample = sample.on(split_batch(sample.batch, pipeline.micro_batches)[0])
    capture = None
    if verifies:
        if sample is None:
            if plan is not None:
                rank_zero_warn(
                    "No batch available before training: the tensor-parallel plan was not verified."
                )
        else:
            capture = BlockInputCapture(first_block_of_each_kind(module, blocks))  # alternating kinds: each
            probes.append(capture)
    if sample is None or not probes:
        return None, None
    if discovery is None and capture is not None:  # the capture alone: no autograd, stop once all are seen
        return None, capture_block_inputs(sample.call, capture.blocks)
    sample.run(probes)
    captured = None
    if capture is not None:
        captured = capture.captured
        if capture.missing:  # arguments that could not be copied off the autograd graph: capture them alone
            captured.update(
                capture_block_inputs(sample.call, {n: capture.blocks[n] for n in capture.missing})
            )
    assert discovery is not None and discovery.result is not None and stage_split is not None
    return pipeline_step.plan_stages(module, stage_split, discovery.result), captured


def compile_blocks(module: nn.Module, blocks: list[str]) -> None:
    """``compile=True``: ``torch.compile`` each block this rank runs, after sharding, as torchtitan does.

    Per-block compilation keeps compile time flat in depth and leaves the communication hooks
    between blocks in eager mode.
    """
    if not blocks:
        rank_zero_warn("`compile=True`: no block list found; nothing was compiled.")
        return
    for name in blocks:
        block = module.get_submodule(name)
        if not isinstance(block, SkippedBlock):
            block.compile()


def check_module_as_given(module: nn.Module) -> None:
    """The recipe starts from the user's whole, materialised model: refuse, on every rank alike, parameters on the
    meta device (nothing to run the sampled step on, nothing to shard) and a model already sharded by hand in
    ``configure_model`` (DTensor parameters, ``fully_shard``), which the recipe would shard a second time."""

    meta = [name for name, p in module.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"HybridParallelStrategy: {len(meta)} parameters are on the meta device (first: `{meta[0]}`). The strategy"
            " runs your step once on the whole model at setup and shards it itself: create the model with real"
            " tensors (`Trainer.init_module()` does here, `empty_init` or not), and load pretrained weights with"
            " `init_weights=`."
        )
    sharded = [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    wrapped = [name for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]
    if sharded or wrapped:
        first = (
            f"`{sharded[0]}` is a DTensor" if sharded else f"`{wrapped[0] or 'the module'}` is fully_shard'ed"
        )
        raise ValueError(
            f"HybridParallelStrategy: the model is already sharded ({first}), e.g. by `parallelize_module` or"
            " `fully_shard` in `configure_model`. The strategy shards the unchanged model itself: remove that code"
            " and give the layout as its arguments (`tensor_parallel=`, `zero_stage=`, ...; a plan of your own:"
            " `plan=`)."
        )
