"""The memory- and bandwidth-saving half of ``HybridParallelStrategy``: arguments, setup, step context.

Kept apart from ``hybrid.py`` (as the pipeline half is), mixed into the strategy:

- at construction, :meth:`MemorySaverArguments.resolve` checks every argument (a ``ValueError``
  names the argument, the value and the fix);
- at setup, after tensor parallelism and the pipeline cut and before compile and data
  parallelism, :meth:`MemorySaversMixin._apply_memory_savers` patches the recomputed modules
  and builds the saved-tensor saver; after data parallelism,
  :meth:`MemorySaversMixin._apply_gradient_compression` installs the compressed all-reduce;
- around every training step (forward, and for pipelines the backward too),
  :meth:`MemorySaversMixin._saved_tensors_context` routes saved activations through the saver.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_parallel.comm.compression import (
    BucketCompressor,
    GradientCompression,
    PowerSGD,
    register_ddp_compression,
    resolve_gradient_compression,
)
from lightning_parallel.memory.checkpointing import CheckpointingConfig, apply_activation_checkpointing
from lightning_parallel.memory.counting import SavedTensorCounter, activate
from lightning_parallel.memory.saved_tensors import COMPRESSIONS, ActivationSaver

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule

    from lightning_parallel.pipeline.setup import PipelineConfig


@dataclass(frozen=True)
class MemorySaverArguments:
    """The strategy's memory- and bandwidth-saving arguments, checked at construction."""

    checkpointing: CheckpointingConfig | None = None
    offload: bool = False
    compression: str | None = None
    gradient_compression: GradientCompression | None = None

    @classmethod
    def resolve(
        cls,
        activation_checkpointing: Any,
        activation_checkpointing_policy: Any,
        activation_offload: Any,
        activation_compression: Any,
        gradient_compression: Any,
        tensor_parallel: Any,
        pipeline: PipelineConfig | None,
    ) -> MemorySaverArguments:
        checkpointing = CheckpointingConfig.resolve(activation_checkpointing, activation_checkpointing_policy)
        if not isinstance(activation_offload, bool):
            raise ValueError(f"`activation_offload={activation_offload!r}` must be True or False.")
        if activation_compression is not None and activation_compression not in COMPRESSIONS:
            raise ValueError(
                f"`activation_compression={activation_compression!r}` is not supported: use 'bf16' (half the"
                " bytes, gradients within about 2^-8 relative), 'fp8' (a quarter, about 2^-4) or None."
            )
        grad_compression = resolve_gradient_compression(gradient_compression)
        # tensor_parallel="auto" is resolved at setup, where the same refusal applies.
        if (
            grad_compression is not None
            and pipeline is None
            and isinstance(tensor_parallel, int)
            and tensor_parallel > 1
        ):
            raise ValueError(
                f"`gradient_compression={gradient_compression!r}` with `tensor_parallel={tensor_parallel!r}` is not"
                " supported: without pipeline stages the data-parallel gradients of sharded parameters are"
                " reduced by FSDP2's `replicate`, which takes no communication hook. Use `tensor_parallel=1`"
                " (DDP hooks) or `pipeline_parallel` > 1 (the pipeline's own all-reduce), or leave"
                " `gradient_compression=None`."
            )
        if (
            checkpointing is not None
            and checkpointing.ops
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
        return cls(checkpointing, activation_offload, activation_compression, grad_compression)

    @property
    def saves_tensors(self) -> bool:
        return self.offload or self.compression is not None


class MemorySaversMixin:
    """Setup steps and the training-step context for memory and bandwidth savers."""

    memory_savers: MemorySaverArguments
    _activation_saver: ActivationSaver | None = None
    activation_counter: SavedTensorCounter | None = None
    """Set (e.g. by :class:`~lightning_parallel.memory.monitor.ActivationMemoryMonitor`) to count each step's activation bytes."""

    def _block_names(self, module: LightningModule) -> list[str]:
        runner = getattr(self, "pipeline_runner", None)
        if runner is not None:
            return list(runner.layout.discovery.block_names)
        plan = getattr(self, "plan", None)
        if plan is not None and plan.block_names:
            return list(plan.block_names)
        from lightning_parallel.plans.detect import find_block_stack

        stack = find_block_stack(module)
        return [f"{stack.name}.{i}" for i in range(len(stack.blocks))] if stack else []

    def _apply_memory_savers(self, module: LightningModule) -> None:
        """Recomputation and the saved-tensor saver; after TP and the pipeline cut, before compile and DP."""
        from lightning_parallel.pipeline.stages import SkippedBlock

        args = self.memory_savers
        names = self._block_names(module)
        kept = [
            module.get_submodule(n) for n in names if not isinstance(module.get_submodule(n), SkippedBlock)
        ]
        notes = []
        if args.checkpointing is not None:
            self._check_tensor_parallel_containers(module, args.checkpointing, names)
            self._check_aux_losses(module, args.checkpointing, names)
            done = apply_activation_checkpointing(
                module,
                args.checkpointing,
                names,
                skip=lambda m: isinstance(m, SkippedBlock),
                capture_state=self._pipeline_state_capture(),
            )
            notes.append(f"activation checkpointing {args.checkpointing.describe()} on {len(done)} module(s)")
        if args.saves_tensors:
            self._activation_saver = ActivationSaver(
                compression=args.compression,  # type: ignore[arg-type]
                offload=args.offload,
                parameters=list(module.parameters()),
                blocks=kept,
            )
            self._hooks += self._activation_saver.handles  # type: ignore[attr-defined]
            module._lp_activation_saver = self._activation_saver  # a later Trainer entry point reuses it
            notes.append(
                f"saved activations: offload={'on' if args.offload else 'off'}, compression={args.compression}"
            )
        if notes:
            rank_zero_info(f"{type(self).__name__}: " + "; ".join(notes))

    def _check_tensor_parallel_containers(
        self, module: LightningModule, config: CheckpointingConfig, names: list[str]
    ) -> None:
        plan = getattr(self, "plan", None)
        if plan is None or not config.patterns:
            return
        from lightning_parallel.memory.checkpointing import select_modules

        sharded = {c.name for c in plan.containers}
        for name, _ in select_modules(module, config, names):
            if name in sharded:
                raise ValueError(
                    f"`activation_checkpointing_policy` selects {name!r}, a tensor-parallel attention/MLP module:"
                    " its input is converted to a DTensor by hooks on the module itself, which a recomputation"
                    " of its forward alone would skip. Select the block that contains it (e.g."
                    f" {name.rsplit('.', 1)[0]!r}) or a module inside it."
                )

    def _check_aux_losses(
        self, module: LightningModule, config: CheckpointingConfig, names: list[str]
    ) -> None:
        """Recomputing an MoE block whose auxiliary loss is collected would record that loss twice."""
        collector = getattr(self, "_aux_losses", None)
        if collector is None:
            return
        from lightning_parallel.memory.checkpointing import select_modules

        moe = {id(info.block): info.name for info in collector.blocks}
        for name, selected in select_modules(module, config, names):
            inside = [moe[id(m)] for m in selected.modules() if id(m) in moe]
            if inside:
                raise ValueError(
                    f"`activation_checkpointing={config.mode!r}` recomputes {name!r}, which holds the MoE block"
                    f" {inside[0]!r} whose auxiliary loss the strategy collects (`moe_aux_loss_coef`, or this"
                    " library's MoE layers under pipeline parallelism): the recomputation in backward would run"
                    " its router again and record the loss a second time. Leave `moe_aux_loss_coef=None`, or"
                    " recompute other modules (`activation_checkpointing='selective',"
                    " activation_checkpointing_policy=[patterns]`), or `activation_checkpointing=None`."
                )

    def _pipeline_state_capture(self) -> Any:
        """For pipeline stages: the recomputation sees the stage that was active in the forward pass."""
        runtime = getattr(self, "_runtime", None)
        if getattr(self, "pipeline_runner", None) is None or runtime is None:
            return None

        def capture() -> Any:
            stage = runtime.active_stage

            @contextmanager
            def restore() -> Iterator[None]:
                previous, runtime.active_stage = runtime.active_stage, stage
                try:
                    yield
                finally:
                    runtime.active_stage = previous

            return restore

        return capture

    def _apply_gradient_compression(self, module: LightningModule) -> None:
        """Compressed data-parallel all-reduce; after data parallelism is applied."""
        compression = self.memory_savers.gradient_compression
        if compression is None:
            return
        dims = self.dims  # type: ignore[attr-defined]
        if not dims.dp_enabled:
            rank_zero_warn(f"`gradient_compression={compression!r}` has no effect without data parallelism.")
            return
        runner = getattr(self, "pipeline_runner", None)
        manual = getattr(self, "_manual_gradient_sync", None)  # expert parallelism: explicit reductions
        if runner is not None:
            runner.gradient_compressor = BucketCompressor(compression)
            if isinstance(compression, PowerSGD):
                _uncompress_tied_weights(runner, module)
        elif manual is not None:
            manual.set_compressor(BucketCompressor(compression))  # the data-parallel means, not the experts'
        elif dims.tp_enabled:
            raise ValueError(
                f"`gradient_compression={compression!r}` with tensor parallelism (tensor_parallel='auto' resolved"
                f" to {dims.tensor_parallel}) is not supported: FSDP2's `replicate` takes no communication hook."
                " Use `tensor_parallel=1`, `pipeline_parallel` > 1, or `gradient_compression=None`."
            )
        else:
            group = self.device_mesh["dp"].get_group()  # type: ignore[attr-defined]
            register_ddp_compression(self._dp_units, compression, group)  # type: ignore[attr-defined]
        rank_zero_info(
            f"{type(self).__name__}: gradient compression {compression!r} on the data-parallel all-reduce"
        )

    @contextmanager
    def _saved_tensors_context(self) -> Iterator[None]:
        """Route the step's saved activations through the saver (and the counter, when one is set)."""
        counter = self.activation_counter
        if counter is not None:
            counter.reset()
        saver = self._activation_saver
        if saver is None:
            module = getattr(self, "lightning_module", None)
            saver = (
                getattr(module, "_lp_activation_saver", None) if self.memory_savers.saves_tensors else None
            )
        if saver is not None:
            with saver.context(counter):
                yield
        elif counter is not None:
            from lightning_parallel.memory.counting import counting

            with counting(counter):
                yield
        else:
            with activate(None):
                yield

    @property
    def activation_bytes(self) -> Any:
        """The last counted step's :class:`~lightning_parallel.memory.counting.ActivationBytes` (or None)."""
        return self.activation_counter.bytes if self.activation_counter is not None else None


def _uncompress_tied_weights(runner: Any, module: LightningModule) -> None:
    """Average weights tied across pipeline stages (a GPT's embedding and head) without PowerSGD.

    Each stage's data-parallel group compresses its own buckets, with its own error feedback and
    random factors: a lossy approximation of the same gradient would differ on the two stages and
    the two copies of the weight would drift apart (measured: 2.8% after 5 steps at pp=2 x dp=2).
    Casts (bf16/fp16) round identical sums identically, so only PowerSGD needs this.
    """
    from lightning_parallel.grad_sync import GradientGroup

    tied = {id(module.get_parameter(name)) for name in runner.tied_groups}
    sync = runner.gradient_sync
    if not tied or sync is None:
        return
    groups = []
    for group in sync.groups:
        if group.compressor is None or not any(id(p) in tied for p in group.parameters):
            groups.append(group)
            continue
        rest = [p for p in group.parameters if id(p) not in tied]
        shared = [p for p in group.parameters if id(p) in tied]
        groups.append(GradientGroup(rest, group.group, group.divisor, group.compressor))
        groups.append(GradientGroup(shared, group.group, group.divisor, None))
    sync.groups[:] = groups
