"""The pipeline half of ``HybridParallelStrategy``: arguments, setup steps and the pipelined hooks.

Kept apart from ``hybrid.py`` so each file has one job; the strategy mixes this in. Under
pipeline parallelism the Trainer's step does forward *and* backward (torch's schedule
interleaves them over micro-batches), so Lightning's backward becomes a no-op that only
runs the hooks, and gradients are synchronised over data-parallel replicas by the runner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.grad_sync import GradientSync
from lightning_parallel.pipeline.microbatch import check_divisible
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.pipeline.schedules import ideal_efficiency, resolve_schedule, virtual_stages_for
from lightning_parallel.pipeline.setup import (
    PipelineConfig,
    cut_for_rank,
    norm_duplicates,
    plan_stages,
    tied_weight_groups,
)
from lightning_parallel.pipeline.stages import StageLayout, StageRuntime
from lightning_parallel.strategy.sample import first_batch, sample_step

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

PIPELINE_BOUNDARIES_KEY = "pipeline_boundaries"


@dataclass
class PipelineArguments:
    """The strategy's pipeline arguments, checked when the strategy is constructed."""

    config: PipelineConfig | None

    @classmethod
    def resolve(
        cls,
        pipeline_parallel: int,
        micro_batches: int | None,
        schedule: str | None,
        virtual_stages: int | None,
        loss_parallel: bool,
    ) -> PipelineArguments:
        if not isinstance(pipeline_parallel, int) or pipeline_parallel < 1:
            raise ValueError(f"`pipeline_parallel={pipeline_parallel!r}` must be a positive integer.")
        if pipeline_parallel == 1:
            for name, value in (
                ("micro_batches", micro_batches),
                ("pipeline_schedule", schedule),
                ("pipeline_virtual_stages", virtual_stages),
            ):
                if value is not None:
                    raise ValueError(
                        f"`{name}={value!r}` needs `pipeline_parallel` > 1. Without pipeline stages there is"
                        " nothing to schedule; for gradient accumulation use `Trainer(accumulate_grad_batches=...)`."
                    )
            return cls(None)
        if loss_parallel:
            raise ValueError(
                "`loss_parallel=True` with `pipeline_parallel` > 1 is not supported: the vocabulary-parallel loss"
                " needs its own backward context, which the pipeline schedule does not enter. Leave"
                " `loss_parallel=False` (the head's logits are gathered on the last stage)."
            )
        spec = resolve_schedule(schedule)
        virtual = virtual_stages_for(spec, virtual_stages)
        config = PipelineConfig(
            pipeline_parallel=pipeline_parallel,
            spec=spec,
            virtual_stages=virtual,
            micro_batches=micro_batches if micro_batches is not None else pipeline_parallel * virtual,
        )
        config.check()
        return cls(config)


class PipelineStrategyMixin:
    """Setup steps and Lightning hooks for pipeline parallelism (used by ``HybridParallelStrategy``)."""

    pipeline: PipelineArguments
    pipeline_runner: PipelineRunner | None
    _sync_blocked: bool
    _pending_gradients: list[torch.Tensor | None]
    _gradient_sync: Any
    _plan_arg: Any
    _runtime: StageRuntime

    # ---- setup ---------------------------------------------------------------------------

    def _plan_pipeline(self, trainer: Trainer, module: LightningModule) -> StageLayout:
        config = self.pipeline.config
        assert config is not None
        if isinstance(self._plan_arg, dict) and PIPELINE_BOUNDARIES_KEY in self._plan_arg:
            config.boundaries = list(self._plan_arg[PIPELINE_BOUNDARIES_KEY])
        batch = first_batch(trainer, self)  # type: ignore[arg-type]
        step = sample_step(trainer, self, batch)  # type: ignore[arg-type]
        if batch is None or step is None:
            raise ValueError(
                "Pipeline parallelism reads one batch at setup to learn how your step calls the model, but no"
                " dataloader was available. Pass the data to `trainer.fit(...)` (or a datamodule)."
            )
        training = trainer.state.fn == TrainerFn.FITTING
        if training:
            check_divisible(batch, config.micro_batches)
        return plan_stages(module, config, step, training)

    def _cut_pipeline(self, module: LightningModule, layout: StageLayout) -> None:
        config = self.pipeline.config
        assert config is not None
        self._runtime = StageRuntime()
        pp_rank = self.device_mesh["pp"].get_local_rank()  # type: ignore[attr-defined]
        self._my_stages, self._owned = cut_for_rank(module, layout, config, pp_rank, self._runtime)

    def _build_pipeline_runner(self, module: LightningModule, layout: StageLayout) -> None:
        config = self.pipeline.config
        assert config is not None
        mesh = self.device_mesh  # type: ignore[attr-defined]
        self.pipeline_runner = PipelineRunner(
            module,
            layout,
            config.spec,
            self._my_stages,
            config.micro_batches,
            mesh["pp"].get_group(),
            self.root_device,  # type: ignore[attr-defined]
            self._runtime,
            self._owned,
            tied_weight_groups(layout, mesh),
        )
        groups = self.pipeline_runner.tied_gradient_groups()
        if not self.zero.enabled:  # type: ignore[attr-defined]  # else ZeRO reduces over dp in its step
            groups += self._expert_gradient_groups(self.pipeline_runner.parameters)  # type: ignore[attr-defined]
        self.pipeline_runner.gradient_sync = self._gradient_sync = GradientSync(groups)
        self.pipeline_runner.aux_collector = getattr(self, "_aux_losses", None)
        if self.pipeline_runner.gradient_compressor is not None:
            self._gradient_sync.set_compressor(self.pipeline_runner.gradient_compressor)
        self.precision_plugin.norm_exclude = norm_duplicates(layout, mesh["pp"].get_local_rank(), module)  # type: ignore[attr-defined]
        self._hooks += self._runtime.handles  # type: ignore[attr-defined]
        ranges = ", ".join(
            f"stage {s} (rank {layout.owners[s]}): blocks {r.start}-{r.stop - 1}"
            for s, r in enumerate(layout.ranges)
        )
        ideal = ideal_efficiency(
            config.spec, config.micro_batches, config.pipeline_parallel, config.virtual_stages
        )
        rank_zero_info(
            f"Pipeline: {config.spec.name}, {config.micro_batches} micro-batches, {ranges}; ideal efficiency {ideal:.2f}"
        )

    @property
    def pipeline_stages(self) -> list[Any]:
        """This rank's ``torch.distributed.pipelining.PipelineStage`` objects (empty without pipelining)."""
        return list(self.pipeline_runner.stages) if self.pipeline_runner else []

    @property
    def pipeline_group(self) -> torch.distributed.ProcessGroup | None:
        return self.pipeline_runner.pp_group if self.pipeline_runner else None

    # ---- hooks ---------------------------------------------------------------------------

    def _pipelined_training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        runner = self.pipeline_runner
        assert runner is not None
        module = self.lightning_module  # type: ignore[attr-defined]
        batch, rest = args[0], args[1:]
        check_divisible(batch, runner.micro_batches)
        scaler = getattr(self.precision_plugin, "scaler", None)  # type: ignore[attr-defined]
        accumulate = module.trainer.accumulate_grad_batches

        def loss_factor(loss: torch.Tensor) -> torch.Tensor:
            loss = loss / accumulate
            return scaler.scale(loss) if scaler is not None else loss

        # MoE auxiliary gradients follow the scale of each micro-batch's loss.
        self._set_aux_loss_scale(runner.micro_batches)  # type: ignore[attr-defined]

        step_fn = functools.partial(module.training_step, **kwargs) if kwargs else module.training_step
        # Lightning zeroes gradients *between* training_step and backward (first batch of an
        # accumulation window), but the schedule has already run backward here. So this batch's
        # gradients are held aside and added in `backward`, after Lightning's zero_grad.
        earlier = runner.detach_gradients()
        try:
            with self.precision_plugin.train_step_context():  # type: ignore[attr-defined]
                loss = runner.train_step(step_fn, batch, rest, loss_factor)
            self._pending_gradients = runner.detach_gradients()
        finally:
            runner.attach_gradients(earlier, add=False)
        return loss

    def _pipelined_eval_step(self, hook: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        runner = self.pipeline_runner
        assert runner is not None
        module = self.lightning_module  # type: ignore[attr-defined]
        step_fn = getattr(module, hook)
        if kwargs:
            step_fn = functools.partial(step_fn, **kwargs)
        with context():
            return runner.eval_step(step_fn, args[0], args[1:])

    def _pipelined_backward(self, closure_loss: torch.Tensor) -> torch.Tensor:
        """The schedule already ran backward: Lightning's hooks around adding this batch's gradients."""
        runner = self.pipeline_runner
        assert runner is not None
        module = self.lightning_module  # type: ignore[attr-defined]
        self.pre_backward(closure_loss)  # type: ignore[attr-defined]
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # type: ignore[attr-defined]
        runner.attach_gradients(self._pending_gradients, add=True)
        self._pending_gradients = []
        if not self._sync_blocked:
            self._gradient_sync()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # type: ignore[attr-defined]
        self.post_backward(closure_loss)  # type: ignore[attr-defined]
        return closure_loss
