"""``HybridParallelStrategy``: the one Lightning strategy that composes every parallelism.

Lifecycle (Lightning's extension contract):

- ``_configure_launcher`` (inside ``Trainer(...)``, before any process is launched): check the
  degrees against ``devices x num_nodes``. A bad layout is a ``ValueError`` here, in the
  user's process, before a single collective exists.
- ``setup_environment``: process group (with a collective timeout, so a lost rank ends the
  job instead of hanging it) and the one named ``DeviceMesh``.
- ``setup``: make parameters identical on every rank, build the plan, verify it on one block
  of each class, shard (tensor/sequence parallel), then replicate over ``dp``; optimizers
  and precision are set up on the sharded parameters.

Checkpointing (``torch.distributed.checkpoint``, sharded per rank) and the barrier/broadcast
collectives are Lightning's ``ModelParallelStrategy`` code, taken member by member in
``strategy/base.py`` (see there why we do not subclass it); its requirement that users write
``configure_model`` is exactly what we remove.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.tensor.parallel import ParallelStyle
from typing_extensions import override

from lightning_parallel.checkpoint.transfer import PathLike, check_init_weights
from lightning_parallel.data_parallel import apply_data_parallel, average_direct_parameters, no_gradient_sync
from lightning_parallel.grad_sync import GradientSync
from lightning_parallel.launch.placement import check_tensor_parallel_placement
from lightning_parallel.mesh import ParallelDims
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.plans import ParallelPlan
from lightning_parallel.precision import convert_precision_plugin
from lightning_parallel.strategy import parallel_state
from lightning_parallel.strategy.checkpointing import ShardedCheckpointing, consolidated_refusal
from lightning_parallel.strategy.compile import compile_blocks
from lightning_parallel.strategy.experts import ExpertStrategyMixin, check_expert_arguments
from lightning_parallel.strategy.memory_savers import MemorySaverArguments, MemorySaversMixin
from lightning_parallel.strategy.pipelined import (
    PipelineArguments,
    PipelineStrategyMixin,
)
from lightning_parallel.strategy.tensor_parallel_setup import TensorParallelSetupMixin
from lightning_parallel.strategy.validation import check_layout_pairs
from lightning_parallel.strategy.zero import ZeroStrategyMixin, check_zero_layout
from lightning_parallel.tensor_parallel.loss_parallel import (
    LossParallelState,
    sharded_loss_backward,
    sharded_loss_step,
    to_plain,
)
from lightning_parallel.zero import ZeroArguments

log = logging.getLogger(__name__)


PlanArg = Literal["auto"] | dict[str, ParallelStyle | str] | ParallelPlan


class HybridParallelStrategy(
    TensorParallelSetupMixin,
    PipelineStrategyMixin,
    ExpertStrategyMixin,
    MemorySaversMixin,
    ZeroStrategyMixin,
    ShardedCheckpointing,
):
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
        moe_aux_loss_coef: add the Switch load-balancing loss of every MoE block, times this,
            to the gradients (the user's loss is left as it is); ``None``: off (the default:
            the user's step may already add it). ``moe_z_loss_coef``: the router z-loss.
        zero_stage: DeepSpeed ZeRO over the data-parallel ranks: 1 shards the optimizer states, 2 also
            the gradients, 3 also the parameters (docs/zero.md; which layouts compose: docs/compatibility.md).
        offload: ``"cpu"`` (optimizer states and their update on the CPU; at stage 3 the parameters
            too; Adam/AdamW become DeepSpeed's CPU Adam) or ``"nvme"`` (stage 3, to ``offload_path``).
        deepspeed_config: extra raw DeepSpeed keys, merged last (not those Lightning owns: precision,
            clipping, accumulation, optimizer).
        activation_checkpointing: ``"full"`` (recompute every block from its input) or ``"selective"``
            (see ``activation_checkpointing_policy``); parameter names are unchanged (docs/memory.md).
        activation_checkpointing_policy: with ``"selective"``: ``"ops"`` (default: keep matmul,
            attention and collective outputs, recompute the cheap ops, as Megatron), an integer
            ``k`` (recompute every k-th block) or a list of module-name patterns to recompute.
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
        loss_parallel: keep the output head's logits sharded over the vocabulary during the
            training step and compute ``F.cross_entropy`` on the shards (Megatron's vocab-parallel
            loss: no all-gather of the logits). Opt-in: the training step may only reshape the
            logits and pass them to ``F.cross_entropy``.
        timeout: collective timeout: a rank that dies ends the job after this long.
        init_weights: a single-file state dict (``.safetensors``, or ``torch.save``'d ``.pt``/``.bin``;
            e.g. a pretrained model, or the unparallelised module's ``state_dict()``) loaded after
            sharding, each rank reading only its own part; names may lack the LightningModule's
            prefix (``model.``). Resuming a run is ``Trainer.fit(ckpt_path=...)`` instead (docs/checkpoints.md).
    """

    strategy_name = "hybrid_parallel"

    def __init__(
        self,
        tensor_parallel: int | Literal["auto"] = 1,
        pipeline_parallel: int = 1,
        expert_parallel: int = 1,
        moe_aux_loss_coef: float | None = None,
        moe_z_loss_coef: float = 0.0,
        sequence_parallel: bool = False,
        micro_batches: int | None = None,
        pipeline_schedule: str | None = None,
        pipeline_virtual_stages: int | None = None,
        zero_stage: int = 0,
        offload: Literal["cpu", "nvme"] | None = None,
        offload_path: str | None = None,
        deepspeed_config: dict[str, Any] | None = None,
        activation_checkpointing: Literal["full", "selective"] | None = None,
        activation_checkpointing_policy: Literal["ops"] | int | list[str] | None = None,
        activation_offload: bool = False,
        activation_compression: Literal["bf16", "fp8"] | None = None,
        gradient_compression: Any = None,
        plan: PlanArg = "auto",
        verify_plan: bool = True,
        compile: bool = False,
        loss_parallel: bool = False,
        save_distributed_checkpoint: bool = True,
        init_weights: PathLike | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=15),
    ) -> None:
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        check_expert_arguments(expert_parallel, moe_aux_loss_coef, moe_z_loss_coef)
        self.init_weights = check_init_weights(init_weights)
        self.zero = ZeroArguments.resolve(zero_stage, offload, offload_path, deepspeed_config)
        check_zero_layout(self.zero, tensor_parallel, pipeline_parallel, expert_parallel, activation_checkpointing)
        refusal = None if save_distributed_checkpoint else consolidated_refusal(
            pipeline_parallel, expert_parallel, self.zero.stage
        )
        if refusal is not None:
            raise ValueError(refusal)
        if tensor_parallel != "auto" and (not isinstance(tensor_parallel, int) or tensor_parallel < 1):
            raise ValueError(f"`tensor_parallel={tensor_parallel!r}` must be a positive integer or 'auto'.")
        if sequence_parallel and tensor_parallel == 1:
            rank_zero_warn("`sequence_parallel=True` has no effect with `tensor_parallel=1`; it is ignored.")
        if not (plan == "auto" or isinstance(plan, (dict, ParallelPlan))):
            raise ValueError(
                f"`plan={plan!r}` must be 'auto', a dict of module-name patterns, or a ParallelPlan."
            )
        self.pipeline = PipelineArguments.resolve(
            pipeline_parallel, micro_batches, pipeline_schedule, pipeline_virtual_stages, loss_parallel
        )
        self.memory_savers = MemorySaverArguments.resolve(
            activation_checkpointing,
            activation_checkpointing_policy,
            activation_offload,
            activation_compression,
            gradient_compression,
            tensor_parallel,
            self.pipeline.config,
        )
        self._tensor_parallel_arg = tensor_parallel
        self.sequence_parallel = sequence_parallel
        self.pipeline_parallel = pipeline_parallel
        self.expert_parallel = expert_parallel
        self.moe_aux_loss_coef = moe_aux_loss_coef
        self.moe_z_loss_coef = moe_z_loss_coef
        self._manual_gradient_sync = None
        self._plan_arg = plan
        self.verify_plan = verify_plan
        self.compile = compile
        self.loss_parallel = loss_parallel
        self._loss_state = LossParallelState()
        self.dims: ParallelDims | None = None
        self.plan: ParallelPlan | None = None
        self._dp_units: list[torch.nn.Module] = []
        self._hooks: list[Any] = []
        self.pipeline_runner: PipelineRunner | None = None
        self._sync_blocked = False

    # ---- layout --------------------------------------------------------------------------

    def _resolve_dims(self) -> ParallelDims:
        world_size = self.num_nodes * self.num_processes
        tp = self.num_processes if self._tensor_parallel_arg == "auto" else self._tensor_parallel_arg
        try:
            return ParallelDims(
                world_size=world_size,
                tensor_parallel=tp,
                pipeline_parallel=self.pipeline_parallel,
                expert_parallel=self.expert_parallel,
            )
        except ValueError as error:
            raise ValueError(
                f"{type(self).__name__}: {error} (Trainer devices={self.num_processes}, num_nodes={self.num_nodes})"
            ) from None

    @override
    def _configure_launcher(self) -> None:
        # Runs inside Trainer(...), before processes are launched: fail here, not in a collective.
        self.dims = self._resolve_dims()
        check_layout_pairs(  # needs the resolved degrees (tensor_parallel="auto")
            tensor_parallel=self.dims.tensor_parallel,
            sequence_parallel=self.sequence_parallel,
            expert_parallel=self.dims.expert_parallel,
        )
        # An unsupported plugin fails here, before launch.
        if self.zero_enabled:
            self._zero_precision_plugin()
        else:
            convert_precision_plugin(self.precision_plugin)
        super()._configure_launcher()

    @property
    def tensor_parallel(self) -> int:
        if self.dims is None:
            raise RuntimeError("The tensor-parallel degree is resolved when the Trainer is created.")
        return self.dims.tensor_parallel

    @override
    def setup_environment(self) -> None:
        if self.dims is None:
            self.dims = self._resolve_dims()
        self._setup_distributed()
        self._device_mesh = self.dims.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        # Lightning's plugin, same precision, with clipping by the global norm over all shards and
        # an fp16 overflow decision shared by every rank.
        pp_group = self._device_mesh["pp"].get_group() if self.dims.pp_enabled else None
        if self.zero_enabled:
            self.precision_plugin = self._zero_precision_plugin()  # DeepSpeed's scaler, master weights, clipping
        else:
            self.precision_plugin = convert_precision_plugin(self.precision_plugin, pipeline_group=pp_group)
        rank_zero_info(
            f"{type(self).__name__}: mesh {self.dims.describe()}, ranks from {type(self.cluster_environment).__name__}"
        )
        check_tensor_parallel_placement(self)  # warn if a tensor-parallel group spans nodes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self.device_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    # ---- setup ---------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None and self.dims is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        module = self.lightning_module
        assert module is not None
        if not parallel_state.restore(self, module):  # a module parallelized by an earlier fit/validate/...
            self._parallelize(trainer, module)
            self._load_init_weights(module)
            parallel_state.remember(self, module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.zero_enabled:
                self._initialize_zero(trainer, module)
        self.setup_precision_plugin()

    def _parallelize(self, trainer: Trainer, module: LightningModule) -> None:
        assert self.dims is not None
        if self.dims.tp_enabled:
            self.plan = self.build_plan(module)  # pure: a bad model fails here on every rank alike
        self._sync_parameters(module)
        layout = self._plan_pipeline(trainer, module) if self.dims.pp_enabled else None
        if self.dims.tp_enabled:
            self._verify_tensor_parallel(trainer, module)
        if layout is not None:
            self._cut_pipeline(module, layout)
        self._apply_expert_parallel(module)
        if self.dims.tp_enabled:
            self._apply_tensor_parallel(module)
        if layout is not None:
            self._build_pipeline_runner(module, layout)
        self._apply_memory_savers(module)
        if self.compile:
            names = self.pipeline_runner.layout.discovery.block_names if self.pipeline_runner else None
            compile_blocks(module, names)
        if self.zero_enabled:
            self._prepare_for_zero(module)  # ZeRO reduces over dp: no DDP hooks
        elif self.dims.ep_enabled and layout is None:
            params = [p for p in module.parameters() if p.requires_grad]
            self._manual_gradient_sync = GradientSync(self._expert_gradient_groups(params))
        elif self.dims.dp_enabled and layout is None:
            dp_mesh = self.device_mesh["dp"]
            block_names = self.plan.block_names if self.plan else []
            self._dp_units = apply_data_parallel(
                module, dp_mesh, block_names, sharded_parameters=self.dims.tp_enabled
            )
            self._hooks += average_direct_parameters(module, dp_mesh)
        self._apply_gradient_compression(module)

    def _sync_parameters(self, module: LightningModule) -> None:
        """Start every rank from rank 0's weights (as DDP does), whatever each rank's init was."""
        if self.world_size > 1:
            from torch.distributed.utils import _sync_module_states

            _sync_module_states(module, torch.distributed.group.WORLD, 250 * 1024 * 1024, 0, set())

    # ---- training-time behaviour ---------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._saved_tensors_context():  # activation offload/compression (memory_savers.py)
            if self.pipeline_runner is not None:
                return self._pipelined_training_step(*args, **kwargs)
            self._set_aux_loss_scale()
            if not self.loss_parallel:
                return self._with_injected_aux(super().training_step(*args, **kwargs))
            assert self.lightning_module is not None
            with sharded_loss_step(self.lightning_module, self._loss_state):
                return self._with_injected_aux(to_plain(super().training_step(*args, **kwargs)))

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.pipeline_runner is not None:
            return self._pipelined_backward(closure_loss)
        if not self.loss_parallel:
            result = super().backward(closure_loss, optimizer, *args, **kwargs)
        else:
            with sharded_loss_backward():
                result = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._manual_gradient_sync is not None and not self._sync_blocked:
            self._manual_gradient_sync()  # expert parallelism: experts and the rest reduced differently
        return result

    # Evaluation: forward-only pipelines under pipeline parallelism, Lightning's step otherwise.
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline_runner is None:
            return super().validation_step(*args, **kwargs)
        return self._pipelined_eval_step(
            "validation_step", self.precision_plugin.val_step_context, *args, **kwargs
        )

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline_runner is None:
            return super().test_step(*args, **kwargs)
        return self._pipelined_eval_step(
            "test_step", self.precision_plugin.test_step_context, *args, **kwargs
        )

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline_runner is None:
            return super().predict_step(*args, **kwargs)
        return self._pipelined_eval_step(
            "predict_step", self.precision_plugin.predict_step_context, *args, **kwargs
        )

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Gradient accumulation: no data-parallel reduction until the last batch of the step.
        self._sync_blocked = True
        try:
            with no_gradient_sync(self._dp_units):
                yield
        finally:
            self._sync_blocked = False

    @override
    def teardown(self) -> None:
        # The hooks stay: they belong to the parallelized module (its parameters stay sharded and
        # its blocks cut), which a later fit/validate/test/predict reuses as it is.
        self._hooks = []
        self.pipeline_runner = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Data + tensor (+ sequence) parallelism for unchanged modules"
        )
        strategy_registry.register("tp2", cls, description="tensor_parallel=2", tensor_parallel=2)
        strategy_registry.register(
            "tp2_sp",
            cls,
            description="tensor_parallel=2 with sequence parallelism",
            tensor_parallel=2,
            sequence_parallel=True,
        )
        strategy_registry.register(
            "tp_auto", cls, description="tensor parallel over each node", tensor_parallel="auto"
        )
