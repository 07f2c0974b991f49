"""``HybridParallelStrategy``: the one Lightning strategy that composes every parallelism.

Lightning's hooks only; what they do is elsewhere:

- ``__init__``: the arguments, checked and resolved into one ``ParallelConfig`` (``config/``).
- ``_configure_launcher`` (inside ``Trainer(...)``, before any process is launched): the degrees
  against ``devices x num_nodes`` and the refused combinations that need them
  (``config/validation.py``): a bad layout is a ``ValueError`` in the user's process.
- ``setup_environment``: process group (with a collective timeout, so a lost rank ends the job
  instead of hanging it), the one named ``DeviceMesh``, the precision plugin.
- ``setup``: the ordered recipe (``parallelize/recipe.py``) on the user's module, then
  ``init_weights``, the optimizers and, under ZeRO, DeepSpeed's engine (``zero/engine.py``).
- the step hooks: the pipeline's (``strategy/pipelined.py``), the memory savers' context, the
  gradient reductions decided at setup (``parallelize/reductions.py``, installed by ``parallelize/gradients.py``).

Checkpoint hooks: ``strategy/checkpointing.py``; Lightning's ``ModelParallelStrategy`` members
(process group, collectives, launcher): ``strategy/base.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_parallel.config import PathLike, PlanArg
from lightning_parallel.config.strategy_arguments import CheckpointPolicyArg, StrategyArguments
from lightning_parallel.config.validation import check_manual_optimization, strategy_config
from lightning_parallel.launch.interrupt import AgreedInterrupt, start_agreed_interrupt
from lightning_parallel.memory.casts import CastSaver
from lightning_parallel.memory.counting import SavedTensorCounter
from lightning_parallel.memory.regather import GatheredInputSaver
from lightning_parallel.mesh import Axis
from lightning_parallel.parallelize import Parallelized, parallelize, recall
from lightning_parallel.parallelize.recipe import check_module_as_given
from lightning_parallel.precision import HybridPrecision
from lightning_parallel.strategy import pipelined
from lightning_parallel.strategy import training as steps
from lightning_parallel.strategy.asked import AskedArguments
from lightning_parallel.strategy.auto_layout import auto_strategy
from lightning_parallel.strategy.checkpointing import CheckpointingStrategy
from lightning_parallel.strategy.data_checks import check_training_data
from lightning_parallel.strategy.made import SetupResults
from lightning_parallel.strategy.predicted_memory import predicting_sample
from lightning_parallel.strategy.presets import PRESETS
from lightning_parallel.strategy.zero_setup import announce_fsdp, initialize_fsdp_offload, initialize_zero
from lightning_parallel.zero.arguments import OffloadUpdate
from lightning_parallel.zero.fsdp import gather_dtype_for
from lightning_parallel.zero.overlapped_step import OverlappedHostStep


class HybridParallelStrategy(AskedArguments, SetupResults, CheckpointingStrategy):
    """Train an unchanged LightningModule with data, tensor, sequence, pipeline and expert parallelism.

    Args:
        tensor_parallel: ranks that shard each layer's matmuls (Megatron style). ``"auto"``
            uses all devices of a node. Must divide the attention heads and hidden sizes.
        sequence_parallel: with ``tensor_parallel > 1``, also shard norms/dropout activations
            along the sequence (all-gather/reduce-scatter instead of all-reduce).
        pipeline_parallel: pipeline stages: the repeated blocks are cut into contiguous runs
            (balanced by parameter count, or ``plan={"pipeline_boundaries": [...]}``), the
            embeddings go to the first stage, final norm, head and loss to the last.
        micro_batches: micro-batches per batch (default: enough to fill the pipeline). Must
            divide the DataLoader's batch size.
        pipeline_schedule: ``"gpipe"``, ``"1f1b"`` (default), ``"interleaved_1f1b"``,
            ``"looped_bfs"``, ``"interleaved_zero_bubble"``, ``"zbv"`` or ``"dualpipev"``
            (torch.distributed.pipelining's schedules).
        pipeline_virtual_stages: stages per rank for the interleaved schedules (default 2).
        expert_parallel: ranks that shard the experts of Mixture-of-Experts blocks (this
            library's ``MoE``, Hugging Face Mixtral/Qwen2-MoE, any router + identical experts),
            carved out of the data-parallel ranks; tokens reach their expert by all-to-all.
        context_parallel: ranks that split every sequence through the whole block stack, attention
            included (carved out of the data-parallel ranks; docs/context_parallel.md).
            ``context_parallel_mode``: ``"ring"`` (keys and values rotate) or ``"ulysses"`` (all-to-all).
        moe_aux_loss_coef: add the Switch load-balancing loss of every MoE block, times this,
            to the gradients (the user's loss is left as it is); ``None``: off (the default:
            the user's step may already add it). ``moe_z_loss_coef``: the router z-loss.
        zero_stage: DeepSpeed ZeRO over the data-parallel ranks: 1 shards the optimizer states, 2 also
            the gradients, 3 also the parameters (docs/zero.md; which layouts compose: docs/compatibility.md).
        offload: ``"cpu"`` (optimizer states and their update on the CPU; at stage 3 the parameters
            too; Adam/AdamW become DeepSpeed's CPU Adam) or ``"nvme"`` (stage 2/3, to ``offload_path``);
            ``offload_ratio``: the fraction offloaded, by FSDP2 unit (DeepSpeed's Twin-Flow ``ratio``);
            ``offload_update``: ``"exact"``, ``"delayed"`` (step i's host step during step i+1) or an
            ``ImportanceSplit`` (the rows with the largest gradients at once, the rest every few steps: docs/zero.md).
        zero_reshard: ZeRO-2/3 under stages: ``"step"`` gathers and reduce-scatters once per step;
            ``"micro_batch"`` once per micro-batch, for ZeRO's memory at every moment (docs/zero.md).
        zero_engine: ``"auto"`` (DeepSpeed's engine or torch's FSDP2, by layout: docs/zero.md), ``"fsdp2"`` or
            ``"deepspeed"`` to insist on one (refused at setup where it cannot run the layout).
        zero_gather_dtype: ``"stored"`` (default: the sharded parameters all-gathered as kept, fp32 under
            ``bf16-mixed``) or ``"compute"`` (ZeRO-2/3 on FSDP2 under ``bf16-mixed``/``16-mixed``: each shard cast to
            the autocast dtype before its all-gather, half the bytes; gradients reduced and kept in fp32).
        deepspeed_config: extra raw DeepSpeed keys, merged last (not those Lightning owns: precision,
            clipping, accumulation, optimizer).
        activation_checkpointing: ``"full"`` (recompute every block from its input) or ``"selective"``
            (see ``activation_checkpointing_policy``); parameter names are unchanged (docs/memory.md).
        activation_checkpointing_policy: with ``"selective"``: ``"ops"`` (default: keep matmul,
            attention and collective outputs, recompute the cheap ops, as Megatron),
            ``"ops_alternate_matmuls"`` (the same, and every second projection matmul of a block
            recomputed too, as torchtitan: about a third less memory for a sixth more forward), an
            integer ``k`` (recompute every k-th block) or a list of module-name patterns to recompute.
        activation_offload: keep activations saved for backward in (pinned) host memory, copied
            back one block ahead of the backward pass.
        activation_compression: ``"bf16"`` or ``"fp8"``: store activations saved for backward in
            that format (the forward pass is unchanged; gradients see the rounding).
        gradient_compression: ``"bf16"``/``"fp16"`` (all-reduce in half precision), ``"powersgd"``
            or ``lightning_parallel.comm.PowerSGD(rank=...)`` on the data-parallel all-reduce
            (data parallel alone, or with pipeline stages; not with tensor parallel alone).
        plan: ``"auto"`` to discover the layout, a dict ``{module-name pattern: style}`` (a torch
            ``ParallelStyle`` or one of ``"colwise"``, ``"rowwise"``, ``"fused_qkv"``,
            ``"fused_gate_up"``, ``"embedding"``, ``"head"``, ``"sequence_parallel"``,
            ``"replicate"``), or a ready ``ParallelPlan``.
        verify_plan: run each distinct block once sharded and once unsharded at setup and refuse
            to train if they differ (cheap; leave it on).
        compile: ``torch.compile`` each transformer block after sharding (as torchtitan does):
            per-block compilation keeps compile time flat in depth and leaves the
            communication hooks between blocks in eager mode.
        loss_parallel: ``None`` (default): with a sharded output head, ``F.cross_entropy`` on its
            logits runs on the vocabulary shards (Megatron's vocab-parallel loss: no all-gather of the
            logits, no fp32 log-probabilities over the whole vocabulary); any other use of the logits
            in the step sees them gathered. ``False``: always gather. ``True``: the logits stay a
            DTensor through the whole step (the step may only reshape them for ``F.cross_entropy``).
        timeout: collective timeout: a rank that dies ends the job after this long.
        init_weights: a single-file state dict (``.safetensors``, or ``torch.save``'d ``.pt``/``.bin``;
            e.g. a pretrained model, or the unparallelised module's ``state_dict()``) loaded after
            sharding, each rank reading only its own part; names may lack the LightningModule's
            prefix (``model.``). Resuming a run is ``Trainer.fit(ckpt_path=...)`` instead (docs/checkpoints.md).
    """

    strategy_name = "hybrid_parallel"

    def __init__(
        self,
        *,
        tensor_parallel: int | Literal["auto"] = 1,
        pipeline_parallel: int = 1,
        expert_parallel: int = 1,
        context_parallel: int = 1,
        context_parallel_mode: Literal["ring", "ulysses"] = "ring",
        moe_aux_loss_coef: float | None = None,
        moe_z_loss_coef: float = 0.0,
        sequence_parallel: bool = False,
        micro_batches: int | None = None,
        pipeline_schedule: str | None = None,
        pipeline_virtual_stages: int | None = None,
        zero_stage: int = 0,
        offload: Literal["cpu", "nvme"] | None = None,
        offload_path: str | None = None,
        offload_ratio: float = 1.0,
        zero_reshard: Literal["step", "micro_batch"] = "step",
        zero_engine: Literal["auto", "deepspeed", "fsdp2"] = "auto",
        offload_update: OffloadUpdate = "exact",
        zero_gather_dtype: Literal["stored", "compute"] = "stored",
        deepspeed_config: dict[str, Any] | None = None,
        activation_checkpointing: Literal["full", "selective"] | None = None,
        activation_checkpointing_policy: CheckpointPolicyArg = None,
        activation_offload: bool = False,
        activation_compression: Literal["bf16", "fp8"] | None = None,
        gradient_compression: Any = None,
        plan: PlanArg = "auto",
        verify_plan: bool = True,
        compile: bool = False,
        loss_parallel: bool | None = None,
        save_distributed_checkpoint: bool = True,
        init_weights: PathLike | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=15),
    ) -> None:
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        arguments = StrategyArguments(
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            expert_parallel=expert_parallel,
            context_parallel=context_parallel,
            context_parallel_mode=context_parallel_mode,
            moe_aux_loss_coef=moe_aux_loss_coef,
            moe_z_loss_coef=moe_z_loss_coef,
            sequence_parallel=sequence_parallel,
            micro_batches=micro_batches,
            pipeline_schedule=pipeline_schedule,
            pipeline_virtual_stages=pipeline_virtual_stages,
            zero_stage=zero_stage,
            offload=offload,
            offload_path=offload_path,
            offload_ratio=offload_ratio,
            zero_reshard=zero_reshard,
            zero_engine=zero_engine,
            offload_update=offload_update,
            zero_gather_dtype=zero_gather_dtype,
            deepspeed_config=deepspeed_config,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_policy=activation_checkpointing_policy,
            activation_offload=activation_offload,
            activation_compression=activation_compression,
            gradient_compression=gradient_compression,
            plan=plan,
            verify_plan=verify_plan,
            compile=compile,
            loss_parallel=loss_parallel,
            save_distributed_checkpoint=save_distributed_checkpoint,
            init_weights=init_weights,
        )
        config = strategy_config(arguments)
        super().__init__(
            config,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.activation_counter: SavedTensorCounter | None = None
        """Set (e.g. by :class:`~lightning_parallel.memory.monitor.ActivationMemoryMonitor`) to count each step's activation bytes."""
        self.casts: CastSaver | None = None
        """Set at setup under ``*-mixed`` precision: the 16-bit casts a step keeps once or not at all (``memory/casts.py``)."""
        self.regather: GatheredInputSaver | None = None
        """Set at setup under tensor parallelism: inputs gathered over tp kept as slices (``memory/regather.py``)."""
        self.host_step: OverlappedHostStep | None = None
        """Set at setup with FSDP2's CPU offload where exact: the host step during backward (``zero/overlapped_step.py``)."""
        self._sync_blocked = False
        self._batch_idx = 0  # Lightning's, for the first batch of an accumulation window
        self._interrupt: AgreedInterrupt | None = None

    @classmethod
    def auto(cls, model: torch.nn.Module, **search: Any) -> HybridParallelStrategy:
        """The layout the planner predicts fastest for ``model`` (``strategy/auto_layout.py: choose_layout``)."""
        return auto_strategy(cls, model, **search)

    # ---- setup ---------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.dims is not None
        given = self.lightning_module
        assert given is not None
        parallelized = recall(given, self.dims.layout)  # a module parallelized by an earlier fit/validate/...
        if parallelized is None:  # a meta or hand-sharded model is refused before the device move fails on it
            check_module_as_given(given)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING:
            check_manual_optimization(
                self.dims.pipeline_parallel, automatic_optimization=module.automatic_optimization
            )
        if parallelized is None:
            training = trainer.state.fn == TrainerFn.FITTING
            sample = predicting_sample(trainer, self, module, training=training)
            parallelized = parallelize(
                module,
                self.config,
                self.dims,
                sample,
                device=self.root_device,
                training=training,
                gather_dtype=gather_dtype_for(self.config.zero, self.precision_plugin.precision),
            )
            if self.config.init_weights is not None:
                self._load_init_weights(module, self.config.init_weights)
            parallelized.remember(module)
        self.parallelized = parallelized
        self.casts = steps.cast_saver(self.precision_plugin)
        self.regather = (
            GatheredInputSaver(self.device_mesh[Axis.TP]) if self.dims.tensor_parallel > 1 else None
        )
        if isinstance(self.precision_plugin, HybridPrecision):
            ep_group = self.device_mesh[Axis.EP].get_group() if parallelized.experts.parameter_ids else None
            self.precision_plugin.set_norm_layout(
                parallelized.norm_exclude, parallelized.experts.parameter_ids, ep_group
            )
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.zero_runs_on == "fsdp2":
                announce_fsdp(self)
            if self.deepspeed_zero:
                initialize_zero(self, trainer, pipelined=parallelized.pipeline is not None)
            elif self.config.zero.offload is not None:  # FSDP2's shards on the CPU: DeepSpeed's CPU Adam
                self._close_host_step()
                self.host_step = initialize_fsdp_offload(self, trainer)
        self.setup_precision_plugin()

    # ---- steps -----------------------------------------------------------------------------

    def _parallelized(self) -> Parallelized:
        if self.parallelized is None:
            raise RuntimeError(f"{type(self).__name__}: a step ran before `setup` parallelized the module.")
        return self.parallelized

    @override
    def on_train_start(self) -> None:
        # data that would hang a rank, or break a stage: on every rank alike
        if self.lightning_module is not None:
            check_training_data(self.lightning_module.trainer, pipelined=self.pipeline_runner is not None)
        # Ctrl+C: every rank stops at one step boundary, where an exception checkpoint resumes exactly.
        self._interrupt = start_agreed_interrupt()
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx
        if self._interrupt is not None and self.lightning_module is not None:
            self._interrupt.check(self.lightning_module.trainer.global_step)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.remember_loader_states()
        return steps.training_step(self, self._parallelized(), super().training_step, args, kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        p = self._parallelized()
        result = steps.backward(self, p, super().backward, closure_loss, (optimizer, *args), kwargs)
        if self.host_step is not None:
            self.host_step.end_of_backward()  # the host steps it started finish before anything reads them
        return result

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # With the host step overlapped, the closure's backward (the step's last) steps each finished shard.
        with self.host_step.armed() if self.host_step is not None else nullcontext():
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._parallelized().gradients.after_step()  # ZeRO-2 on FSDP2: the updated shards gathered again
        return output

    # Evaluation: forward-only pipelines under pipeline parallelism, Lightning's step otherwise.
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _eval_step(self, hook: str, context: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runner = self.pipeline_runner
        if runner is None:
            return getattr(super(), hook)(*args, **kwargs)
        assert self.lightning_module is not None
        return pipelined.eval_step(runner, self.lightning_module, hook, context, args, kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Gradient accumulation: no data-parallel reduction until the last batch of the step.
        self._sync_blocked = True
        try:
            with self._parallelized().gradients.paused():
                yield
        finally:
            self._sync_blocked = False

    @override
    def teardown(self) -> None:
        # The hooks and the stages stay with the module (a later fit/validate/test/predict reuses it);
        # the strategy lets go of its runner, and keeps the plan to show (``strategy.plan``).
        if self.parallelized is not None:
            self.parallelized = dataclasses.replace(self.parallelized, pipeline=None)
        self._close_host_step()
        if self._interrupt is not None:
            self._interrupt.uninstall()
            self._interrupt = None
        super().teardown()

    def _close_host_step(self) -> None:
        if self.host_step is not None:  # closed, it keeps its record (the tests' engagement reads it)
            self.host_step.close()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, description, arguments in PRESETS:
            strategy_registry.register(name, cls, description=description, **arguments)
