"""Every refused combination of the strategy's arguments: the one place to add a refusal.

A refusal names the argument, the value and the fix, and is raised before any process could
hang on a collective:

- :func:`strategy_config`, inside ``HybridParallelStrategy(...)``: each argument alone
  (``config/arguments.py``), and the pairs that need nothing but the arguments, in the order a
  user meets them;
- :func:`check_launch`, inside ``Trainer(...)`` once ``tensor_parallel="auto"`` is resolved and the
  Trainer's precision is known, before any process is launched;
- :func:`check_zero_optimizers`, at setup, when ``configure_optimizers`` has run.

Checks that need the model (a head count that ``tensor_parallel`` does not divide, no block list
to cut, no MoE block to shard) are raised by the setup step that inspects it; objects the user
builds (``ParallelDims``, ``PowerSGD``, ``ParallelPlan``) check their own fields. Why each pair is
refused is said in its message; docs/compatibility.md lists them.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_parallel.config import arguments
from lightning_parallel.config.parallel_config import (
    PIPELINE_BOUNDARIES_KEY,
    ContextParallelConfig,
    MemorySaverConfig,
    ParallelConfig,
    TensorParallelConfig,
)
from lightning_parallel.config.strategy_arguments import StrategyArguments
from lightning_parallel.mesh import ParallelDims
from lightning_parallel.pipeline.setup import PipelineConfig
from lightning_parallel.zero import ZeroPrecision
from lightning_parallel.zero.arguments import AUTOCAST_DTYPES, ZERO_PRECISIONS, ZeroArguments
from lightning_parallel.zero.engine_choice import config_engine


def strategy_config(a: StrategyArguments) -> ParallelConfig:
    """``HybridParallelStrategy``'s arguments, checked and resolved."""
    experts = arguments.experts(a.expert_parallel, a.moe_aux_loss_coef, a.moe_z_loss_coef)
    weights = arguments.init_weights(a.init_weights)
    zero = arguments.zero(
        a.zero_stage,
        a.offload,
        a.offload_path,
        a.deepspeed_config,
        a.offload_ratio,
        a.zero_reshard,
        a.zero_engine,
        a.offload_update,
        a.zero_gather_dtype,
    )
    tp, pp, plan = a.tensor_parallel, a.pipeline_parallel, a.plan
    if isinstance(tp, int) and (refusal := importance_split_refusal(zero.update, tp)) is not None:
        raise ValueError(refusal)  # "auto" degrees: at setup (strategy/zero_setup.py)
    if not a.save_distributed_checkpoint:
        refusal = consolidated_refusal(pp, a.expert_parallel, zero.stage)
        if refusal is not None:
            raise ValueError(refusal)
    arguments.tensor_parallel(tp)
    if a.sequence_parallel and tp == 1:
        rank_zero_warn("`sequence_parallel=True` has no effect with `tensor_parallel=1`; it is ignored.")
    arguments.plan(plan)
    arguments.loss_parallel(a.loss_parallel)
    if a.loss_parallel is True and isinstance(pp, int) and pp > 1:
        raise ValueError(
            "`loss_parallel=True` with `pipeline_parallel` > 1 is not supported: the vocabulary-parallel loss"
            " needs its own backward context, which the pipeline schedule does not enter. Leave the default"
            " `loss_parallel=None` (F.cross_entropy on the head's logits runs on the vocabulary shards there too)."
        )
    boundaries = plan.get(PIPELINE_BOUNDARIES_KEY) if isinstance(plan, dict) else None
    pipeline = arguments.pipeline(
        pp, a.micro_batches, a.pipeline_schedule, a.pipeline_virtual_stages, boundaries
    )
    _check_zero_reshard(zero, pipeline)
    _check_gather_dtype(zero, pipeline)
    memory = arguments.memory_savers(
        a.activation_checkpointing,
        a.activation_checkpointing_policy,
        a.activation_offload,
        a.activation_compression,
        a.gradient_compression,
    )
    _check_memory_savers(memory, a.gradient_compression, tp, pipeline, zero)
    context = arguments.context_parallel(a.context_parallel, a.context_parallel_mode)
    _check_context(context, compile=a.compile)
    styles = (
        {k: v for k, v in plan.items() if k != PIPELINE_BOUNDARIES_KEY} if isinstance(plan, dict) else plan
    )
    tensor = TensorParallelConfig(tp, a.sequence_parallel, styles, a.verify_plan, a.loss_parallel)
    return ParallelConfig(tensor, pipeline, experts, zero, memory, a.compile, weights, context)


def importance_split_refusal(update: object, tensor_parallel: int) -> str | None:
    """Why ``offload_update`` cannot run with ``tensor_parallel`` ranks (None: it can)."""
    if update in ("exact", "delayed") or tensor_parallel <= 1:
        return None
    return (
        f"`offload_update={update!r}` with `tensor_parallel={tensor_parallel}`: the importance split chooses rows over"
        " each whole matrix and has been tested with data parallelism alone (a tensor-parallel cut of the rows, fused"
        " q|k|v's strided one included, is not handled). Use `tensor_parallel=1`, or `offload_update='exact'` or"
        " 'delayed'."
    )


def _check_gather_dtype(zero: ZeroArguments, pipeline: PipelineConfig | None) -> None:
    """``zero_gather_dtype``: the dtype FSDP2 all-gathers the sharded parameters in (``zero/fsdp.py: gather_policy``)."""
    gather_dtype, stage, engine = zero.gather_dtype, zero.stage, zero.engine
    if gather_dtype not in ("stored", "compute"):
        raise ValueError(
            f"`zero_gather_dtype={gather_dtype!r}` must be 'stored' (gather the parameters as they are kept, the"
            " default) or 'compute' (cast each shard to the autocast dtype before the all-gather)."
        )
    if gather_dtype == "stored":
        return
    if stage not in (2, 3) or engine == "deepspeed":
        what = f"`zero_stage={stage}`" if stage not in (2, 3) else "`zero_engine='deepspeed'`"
        raise ValueError(
            f"`zero_gather_dtype='compute'` with {what}: the cast before the all-gather is FSDP2's"
            " (`MixedPrecisionPolicy`), which runs ZeRO-2 and ZeRO-3. Set `zero_stage=2` or 3 with"
            " `zero_engine='auto'` or 'fsdp2', or leave `zero_gather_dtype='stored'`."
        )
    if zero.raw_config:
        raise ValueError(
            "`zero_gather_dtype='compute'` with `deepspeed_config`: the option runs ZeRO on FSDP2, which reads no"
            " DeepSpeed keys (they would be dropped silently). Remove `deepspeed_config`, or leave"
            " `zero_gather_dtype='stored'` for DeepSpeed's engine."
        )
    if pipeline is not None and pipeline.spec.bubble_free_backward:
        raise ValueError(
            f"`zero_gather_dtype='compute'` with `pipeline_schedule={pipeline.spec.name!r}`: a zero-bubble schedule"
            " adds each micro-batch's weight gradient into the gathered parameter's own gradient, which would be"
            " 16-bit (torch's stage_backward_weight), so the micro-batches would be summed in 16 bits. Use '1f1b',"
            " 'gpipe' or 'interleaved_1f1b', or leave `zero_gather_dtype='stored'`."
        )


def _check_zero_reshard(zero: ZeroArguments, pipeline: PipelineConfig | None) -> None:
    """``zero_reshard='micro_batch'`` says when units give back memory between the micro-batches of stages."""
    if zero.reshard != "micro_batch":
        return
    if pipeline is None:
        raise ValueError(
            "`zero_reshard='micro_batch'` needs `pipeline_parallel` > 1: without stages there are no micro-batches"
            " inside a step (ZeRO-3 already reshards after every forward and backward). Leave `zero_reshard='step'`."
        )
    if pipeline.spec.bubble_free_backward:
        raise ValueError(
            f"`zero_reshard='micro_batch'` with `pipeline_schedule={pipeline.spec.name!r}`: a zero-bubble schedule"
            " computes the weight gradients in a later pass over the parameters the input-gradient pass used,"
            " so a unit cannot give them back after each micro-batch's backward. Use a schedule without a"
            " split backward ('1f1b', 'gpipe', 'interleaved_1f1b') or `zero_reshard='step'`."
        )


def _check_context(context: ContextParallelConfig, *, compile: bool) -> None:
    """What context parallelism does not compose with yet (docs/context_parallel.md, "Layouts")."""
    if not context.enabled:
        return
    if compile:
        raise ValueError(
            f"`compile=True` with `context_parallel={context.degree}` is not supported yet: the blocks' attention"
            " calls are routed through the ring by a torch function mode, which per-block compilation has not been"
            " checked against. Leave `compile=False` under context parallelism."
        )


def _check_memory_savers(
    memory: MemorySaverConfig,
    argument: Any,
    tensor_parallel: Any,
    pipeline: PipelineConfig | None,
    zero: ZeroArguments,
) -> None:
    compression, gradient_compression = memory.gradient_compression, argument
    # tensor_parallel="auto" is resolved before launch (check_launch), where the same refusal applies.
    if compression is not None and isinstance(tensor_parallel, int):
        problem = compression_with_tensor_parallel_problem(gradient_compression, tensor_parallel, pipeline)
        if problem:
            raise ValueError(problem)
    if compression is not None and zero.enabled:
        raise ValueError(
            f"`gradient_compression={gradient_compression!r}` with `zero_stage={zero.stage}` is not supported:"
            " DeepSpeed's engine reduces the data-parallel gradients itself (in its step, or inside backward at"
            " stages 2-3) and takes no compression hook here, so the setting would be silently ignored. Leave"
            " `gradient_compression=None` with ZeRO, or use `zero_stage=0`."
        )
    if (
        memory.checkpointing is not None
        and memory.checkpointing.ops
        and pipeline is not None
        and pipeline.spec.bubble_free_backward
    ):
        raise ValueError(
            f"`activation_checkpointing='selective'` (policy 'ops') with `pipeline_schedule="
            f"{pipeline.spec.name!r}` is not supported: that schedule runs backward twice over each stage"
            " (input gradients, then weight gradients) and torch's selective checkpointing allows one"
            " backward per region. Use `activation_checkpointing='full'`, a block policy"
            " (`activation_checkpointing_policy=2`), or the '1f1b' / 'interleaved_1f1b' schedule."
        )


# ---- pairs ------------------------------------------------------------------------------------


def consolidated_refusal(pipeline_parallel: int, expert_parallel: int, zero_stage: int) -> str | None:
    """Why one consolidated checkpoint file cannot hold this layout (``None``: it can).

    Asked at construction (before any process exists) and again at each save and load, because
    ``save_distributed_checkpoint`` can be changed on the strategy in between.
    """
    if zero_stage:
        return (
            "`save_distributed_checkpoint=False` (one consolidated file) is not supported with ZeRO: every master"
            " weight would be gathered on rank 0 at each save. Save the sharded checkpoint (the default) and turn it"
            " into one fp32 state dict afterwards with `lightning_parallel.consolidate_checkpoint(path)` or"
            " `python -m lightning_parallel export CHECKPOINT OUT.safetensors`."
        )
    if pipeline_parallel > 1 or expert_parallel > 1:
        return (
            "`save_distributed_checkpoint=False` (one consolidated file) is not supported with"
            f" `pipeline_parallel={pipeline_parallel}` / `expert_parallel={expert_parallel}` yet: each rank holds"
            " different weights under the same names, and the file would keep rank 0's only. Leave it True"
            " (sharded checkpoints hold every weight) and export a checkpoint folder as one file with"
            " `python -m lightning_parallel export CKPT model.safetensors` (docs/checkpoints.md)."
        )
    return None


# ---- before launch, and at setup ------------------------------------------------------------------


def resolve_dims(config: ParallelConfig, strategy: str, devices: int, num_nodes: int) -> ParallelDims:
    """The degrees for ``devices x num_nodes`` ranks (``tensor_parallel="auto"``: the devices of a node)."""
    tp = devices if config.tensor.degree == "auto" else config.tensor.degree
    try:
        return ParallelDims(
            world_size=num_nodes * devices,
            tensor_parallel=tp,
            pipeline_parallel=config.pipeline.pipeline_parallel if config.pipeline else 1,
            expert_parallel=config.experts.expert_parallel,
            context_parallel=config.context.degree,
        )
    except ValueError as error:
        raise ValueError(f"{strategy}: {error} (Trainer devices={devices}, num_nodes={num_nodes})") from None


def check_launch(config: ParallelConfig, dims: ParallelDims, precision_plugin: Any) -> None:
    """The pairs that need the resolved degrees or the Trainer's precision; before any process is launched."""
    tp, ep = dims.tensor_parallel, dims.expert_parallel
    if config.tensor.sequence_parallel and tp > 1 and ep > 1:
        raise ValueError(
            f"HybridParallelStrategy(`sequence_parallel=True`, `tensor_parallel={tp}`,"
            f" `expert_parallel={ep}`) is not supported: under sequence parallelism each"
            " tensor-parallel rank holds a slice of the sequence, and the MoE blocks (which tensor parallelism"
            " does not shard) would route only their rank's tokens, so expert capacity, drops and the"
            " load-balancing loss would differ from the unsharded model. Nearest supported layouts:"
            f" `sequence_parallel=False` with `tensor_parallel={tp}` and"
            f" `expert_parallel={ep}`, or `sequence_parallel=True` with `expert_parallel=1`."
        )
    compression = config.memory.gradient_compression
    # tensor_parallel="auto", resolved now: the constructor's refusal, whatever dp is
    if compression is not None:
        problem = compression_with_tensor_parallel_problem(compression, tp, config.pipeline)
        if problem:
            raise ValueError(problem)
        if not dims.dp_enabled:
            rank_zero_warn(f"`gradient_compression={compression!r}` has no effect without data parallelism.")
    if config.zero.enabled:  # also under FSDP2 (ZeRO-3 with tp): Lightning's plain plugins only, as tested
        check_zero_precision(config.zero, precision_plugin)
        check_zero_shards_something(config, dims)
        check_gather_precision(config.zero, precision_plugin)


def compression_with_tensor_parallel_problem(
    compression: Any, tensor_parallel: int, pipeline: PipelineConfig | None
) -> str | None:
    """Why gradient compression cannot run with ``tensor_parallel`` ranks (None: it can). One rule for the
    constructor (an integer degree) and the launch (``"auto"`` resolved), with or without experts."""
    if pipeline is not None or tensor_parallel <= 1:
        return None
    return (
        f"`gradient_compression={compression!r}` with `tensor_parallel={tensor_parallel}` is not supported:"
        " without pipeline stages the data-parallel gradients of sharded parameters are reduced by FSDP2's"
        " `replicate`, which takes no communication hook. Use `tensor_parallel=1` (DDP hooks) or"
        " `pipeline_parallel` > 1 (the pipeline's own all-reduce), or leave `gradient_compression=None`."
    )


def check_zero_shards_something(config: ParallelConfig, dims: ParallelDims) -> None:
    """DeepSpeed's engine under expert parallelism shards over the experts' replicas only (``zero/groups.py``):
    with as many expert ranks as data-parallel ranks it would shard nothing, silently."""
    ep, dp = dims.expert_parallel, dims.data_parallel
    if ep > 1 and dp // ep == 1 and config_engine(config, dims) == "deepspeed":
        raise ValueError(
            f"`zero_stage={config.zero.stage}` with `expert_parallel={ep}` on {dp} data-parallel ranks would shard"
            " nothing: this layout runs ZeRO on DeepSpeed's engine, which shards over the replicas of each"
            f" expert (data parallel / expert parallel = {dp // ep} rank). Use `zero_stage=2` or 3 (FSDP2 shards"
            f" the dense weights over all {dp} data-parallel ranks and the experts over their replicas), or"
            f" more data-parallel ranks than `expert_parallel` (e.g. {2 * dp} ranks)."
        )


def check_zero_precision(zero: ZeroArguments, plugin: Any) -> None:
    """DeepSpeed owns the precision under ZeRO: a plugin doing more than Lightning's flag is refused.

    Anything beyond Lightning's plain plugins (fp8, quantisation, a custom scaler) would be
    silently dropped: DeepSpeed owns the casts, the master weights and the loss scale here.
    """

    if isinstance(plugin, ZeroPrecision):
        return
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
        raise ValueError(
            f"HybridParallelStrategy(zero_stage={zero.stage}): the precision plugin"
            f" {type(plugin).__name__} cannot be used with ZeRO, DeepSpeed owns the precision (casts, fp32"
            " master weights, loss scale). Use `Trainer(precision='32-true' | 'bf16-mixed' | 'bf16-true' |"
            " '16-mixed')`, or `zero_stage=0` to keep this plugin."
        )
    if plugin.precision not in ZERO_PRECISIONS:
        raise ValueError(
            f"HybridParallelStrategy(zero_stage={zero.stage}): `Trainer(precision={plugin.precision!r})` is not"
            " supported with ZeRO; use one of"
            f" {sorted(ZERO_PRECISIONS)} (DeepSpeed keeps fp32 master weights for the half precisions)."
        )


def check_gather_precision(zero: ZeroArguments, plugin: Any) -> None:
    """``zero_gather_dtype='compute'`` casts to the autocast dtype: the Trainer's precision must have one."""
    precision = getattr(plugin, "precision", None)
    if zero.gather_dtype == "compute" and precision not in AUTOCAST_DTYPES:
        raise ValueError(
            f"`zero_gather_dtype='compute'` with `Trainer(precision={precision!r})`: there is no lower compute"
            " dtype to gather in (fp32 computes in the stored dtype; '-true' precisions already store their"
            " parameters in it). Use `Trainer(precision='bf16-mixed')` or '16-mixed', or leave"
            " `zero_gather_dtype='stored'`."
        )


def check_zero_optimizers(
    zero: ZeroArguments, num_optimizers: int, num_schedulers: int, trainer: Any
) -> None:
    """At setup, once ``configure_optimizers`` has run: what DeepSpeed's engine can drive."""
    if num_optimizers != 1 or num_schedulers > 1:
        raise ValueError(
            f"`zero_stage={zero.stage}`: `configure_optimizers` returned {num_optimizers} optimizers"
            f" and {num_schedulers} schedulers; DeepSpeed drives exactly one optimizer (and at"
            " most one scheduler). Put all parameter groups into one optimizer."
        )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
        raise ValueError(
            "`Trainer(gradient_clip_algorithm='value')` with ZeRO: DeepSpeed clips by the global norm only."
            " Use `gradient_clip_algorithm='norm'`."
        )


def check_manual_optimization(pipeline_parallel: int, *, automatic_optimization: bool) -> None:
    """Manual optimization under pipeline stages, refused at setup before any collective."""
    if pipeline_parallel > 1 and not automatic_optimization:
        raise ValueError(
            f"HybridParallelStrategy(pipeline_parallel={pipeline_parallel}) runs each training step as a pipeline"
            " schedule that does forward and backward itself, per micro-batch: manual optimization"
            " (`automatic_optimization = False`, `manual_backward`) has no place in it. Use automatic"
            " optimization, or pipeline_parallel=1 (tensor, expert, data parallelism and ZeRO allow it)."
        )
