"""Run the user's step as a pipeline inside the Trainer's step: training, evaluation, gradient sync.

Training uses torch's schedules (``torch.distributed.pipelining``): each rank's stages are
:class:`~lightning_parallel.pipeline.stages.StageModule` objects whose forward runs the user's
``training_step`` on one micro-batch, cut to the stage. The last stage's output *is* the
user's loss; the schedule's loss function only scales it (micro-batches, gradient
accumulation, the fp16 loss scale), and runs backward.

The data-parallel reduction overlaps each stage's last backward of the batch
(``pipeline/last_backward.py``).

Evaluation (validation, test, predict) is forward-only and needs no autograd, so it is a plain
chain of point-to-point sends in stage order (shapes travel with the tensors: evaluation
batches may differ in size from training ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class

from lightning_parallel.data_parallel.gradient_sync import GradientGroup
from lightning_parallel.pipeline.discover import PipelineSetupError, extract_loss
from lightning_parallel.pipeline.eval_transfers import StageChain, merge_outputs, to_cpu, to_device
from lightning_parallel.pipeline.last_backward import LastBackward, ReducingStage
from lightning_parallel.pipeline.microbatch import (
    LogRecorder,
    StepLogs,
    batch_size_of,
    replay_logs,
    split_batch,
)
from lightning_parallel.pipeline.schedules import ScheduleSpec
from lightning_parallel.pipeline.send_release import SendRelease
from lightning_parallel.pipeline.stages import StageExit, StageLayout, StageModule, StageRuntime
from lightning_parallel.zero.fsdp_schedule import finish_interrupted_forwards
from lightning_parallel.zero.tensor_parallel import registered_parameter, user_name


@dataclass
class _StepContext:
    step_fn: Callable[..., Any]
    micro_batches: list[Any]
    step_args: tuple[Any, ...]
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    current: int = 0
    aux: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (stage, mb) -> injected MoE aux
    training: bool = False  # torch's schedule takes the last stage's output: the loss tensor alone
    loss_factor: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss  # what backward starts from


class PipelineRunner:
    """One rank's stages, its schedule, and the collectives a pipelined step needs."""

    def __init__(
        self,
        module: nn.Module,
        layout: StageLayout,
        spec: ScheduleSpec,
        my_stages: list[int],
        micro_batches: int,
        pp_group: dist.ProcessGroup,
        device: torch.device,
        runtime: StageRuntime,
        owned_names: set[str],
        tied_groups: dict[str, dist.ProcessGroup],
        aux_collector: Any = None,
        fsdp_units: Sequence[nn.Module] = (),
        fsdp_before_schedule: Callable[[list[nn.Module]], None] | None = None,
    ) -> None:
        self.module = module
        self.layout = layout
        self.spec = spec
        self.my_stages = my_stages
        self.micro_batches = micro_batches
        self.pp_group = pp_group
        self.pp_rank = dist.get_rank(pp_group)
        self.device = device
        self.runtime = runtime
        self.tied_groups = tied_groups  # this rank's name -> group of the ranks holding that tied weight
        self.last_stage = layout.num_stages - 1
        self.last_owner = layout.owners[self.last_stage]
        self.logs = LogRecorder()
        self.step_logs = StepLogs()  # the last stage's loss and logs to every stage, each training step
        self.eval_logs = StepLogs()  # and each evaluation step (its own structure: other names are logged)
        # An ``AuxLossCollector`` in backward mode (MoE models), or None.
        self.aux_collector = aux_collector
        # ZeRO on FSDP2 (zero/fsdp.py): its units reduce once per batch, during their stages' last backward.
        self.fsdp_units = list(fsdp_units)
        # How they are set before each schedule (``zero/fsdp_schedule.py: before_schedule``, from ``zero_reshard``).
        self.fsdp_before_schedule = fsdp_before_schedule
        self.batch_size: int | None = None  # of the training batches the stages were built for
        self._held: list[torch.Tensor | None] = []
        self._ctx: _StepContext | None = None  # the step running now: see _running
        # a step's sends let go as they complete, under torch's runtime (pipeline/send_release.py)
        self.sends = SendRelease(enabled=spec.multi_stage)
        # a local-shard weight under its name; a weight several blocks share under each of its names
        params = {user_name(n): p for n, p in module.named_parameters(remove_duplicate=False)}
        self.parameters = [params[n] for n in sorted(owned_names) if n in params]
        names = {s: self._stage_parameter_names(s, params) for s in my_stages}
        self.last_backward = LastBackward(
            module, {s: [params[n] for n in names[s]] for s in names}, self.fsdp_units
        )
        self.stage_modules = [StageModule(s, module, names[s], self.run_stage) for s in my_stages]
        self.stages = [
            ReducingStage(sm, s, layout.num_stages, device, group=pp_group, last_backward=self.last_backward)
            for sm, s in zip(self.stage_modules, my_stages, strict=False)
        ]
        schedule_cls = get_schedule_class(spec.torch_name)
        target = self.stages if spec.multi_stage else self.stages[0]
        try:
            self.schedule = schedule_cls(
                target, n_microbatches=micro_batches, loss_fn=self._loss_fn, scale_grads=False
            )
        except (ValueError, AssertionError) as error:
            raise ValueError(
                f"`pipeline_schedule={spec.name!r}` with `micro_batches={micro_batches}` and"
                f" {layout.num_stages} stages: torch refused the layout ({error})."
            ) from None

    def _stage_parameter_names(self, stage: int, params: dict[str, nn.Parameter]) -> list[str]:
        names = {
            self.layout.name_in_stage(n, stage) for n, s in self.layout.parameter_stages.items() if stage in s
        }
        return [n for n in sorted(names) if n in params]

    @property
    def weights_named_apart(self) -> dict[str, str]:
        """This rank's name -> the one-process name of each weight this rank's blocks know by another name."""
        return self.layout.aliases_on_rank(self.layout.owners[self.my_stages[0]])

    @property
    def holds_last_stage(self) -> bool:
        return self.last_stage in self.my_stages

    # ---- inside the schedule -------------------------------------------------------------

    @contextmanager
    def _running(self, ctx: _StepContext) -> Iterator[None]:
        """``ctx`` is the step that torch's schedule (training) or the stage chain (evaluation) runs: its stage
        forwards and loss function, called by torch with tensors only, read the step's function, micro-batches and
        losses from here, and only while the step runs."""
        self._ctx = ctx
        try:
            yield
        finally:
            self._ctx = None

    def run_stage(self, stage: int, received: torch.Tensor | None, mb_index: int) -> Any:
        ctx = self._ctx
        if ctx is None:
            raise RuntimeError("A pipeline stage ran outside a pipelined step.")
        ctx.current = mb_index
        self.runtime.active_stage, self.runtime.active_micro_batch = stage, mb_index
        self.runtime.injected = received
        collector = self.aux_collector
        first_aux = len(collector.injected) if collector is not None else 0
        try:
            output = ctx.step_fn(ctx.micro_batches[mb_index], *ctx.step_args)
        except StageExit as exit_:
            if self.fsdp_units:
                finish_interrupted_forwards(self.fsdp_units, exit_.hidden)
            return exit_.hidden
        finally:
            self.runtime.active_stage = self.runtime.active_micro_batch = None
            self.runtime.injected = None
            if collector is not None and len(collector.injected) > first_aux:
                # keyed by (stage, micro-batch): torch's shape inference may run micro-batch 0 twice
                ctx.aux[(stage, mb_index)] = torch.stack(collector.injected[first_aux:]).sum()
        if stage != self.last_stage:
            raise PipelineSetupError(
                f"Pipeline stage {stage} finished the step without reaching the end of its blocks."
            )
        if not ctx.training:  # evaluation merges the outputs; a training step's (logits in a dict) would
            ctx.outputs[mb_index] = output  # stay alive for every micro-batch until the step ends
        # a dict with "loss" (and more) is Lightning's
        return extract_loss(output) if ctx.training else output

    def _loss_fn(self, output: Any, target: Any) -> torch.Tensor:
        ctx = self._ctx
        assert ctx is not None
        loss = extract_loss(output)
        ctx.losses[ctx.current] = loss.detach()
        return ctx.loss_factor(loss)

    # ---- training ------------------------------------------------------------------------

    def train_step(
        self,
        step_fn: Callable[..., Any],
        batch: Any,
        step_args: Sequence[Any],
        loss_factor: Callable[[torch.Tensor], torch.Tensor],
        *,
        final: bool = True,
        first_of_window: bool = True,
    ) -> torch.Tensor:
        """One pipelined forward+backward; returns the batch loss (mean over micro-batches) on every stage.

        ``final``: this batch ends an optimizer step (the explicit reductions run during the stages'
        last backward). ``first_of_window``: Lightning zeroes the gradients after this step (the first
        batch of an accumulation window), so the schedule starts from none; otherwise it adds to the
        window's gradients, and what the reductions launch during backward is the window's whole sum.

        The gradients it produces are held aside until :meth:`add_held_gradients`: Lightning zeroes
        gradients *between* ``training_step`` and ``backward`` (first batch of an accumulation
        window), but the schedule has already run backward inside the step.
        """
        m = self.micro_batches
        earlier = self.detach_gradients() if first_of_window else []
        ctx = _StepContext(
            step_fn,
            split_batch(batch, m),
            tuple(step_args),
            training=True,
            loss_factor=lambda x: loss_factor(x) / m,
        )
        self.last_backward.start_batch(ends_step=final)
        self.logs.clear()
        index = torch.arange(m)  # on the host: each stage reads its micro-batch's index without a device sync
        target = torch.zeros(m, device=self.device)
        try:
            if self.fsdp_units and self.fsdp_before_schedule is not None:
                self.fsdp_before_schedule(self.fsdp_units)
            with (
                self._running(ctx),
                self.logs.recording(self.module, lambda: ctx.current),
                self.sends.during_step(self.stages),
            ):
                self.schedule.step(mb_index=index, target=target, return_outputs=False)
            self.last_backward.end_batch()
            loss = self._finish(ctx.losses) + self._aux_mean(ctx)
            self._held = self.detach_gradients()
        finally:
            if earlier:
                self.attach_gradients(earlier, add=False)
        return loss

    def _aux_mean(self, ctx: _StepContext) -> torch.Tensor:
        """MoE auxiliary losses injected on every stage, averaged over micro-batches: the part of the
        user's loss that the last stage cannot see (its ``moe_aux_loss`` gets 0 for injected layers)."""
        if self.aux_collector is None:
            return torch.zeros((), device=self.device)
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        for value in ctx.aux.values():
            local += value.float().to(self.device)
        local /= self.micro_batches
        dist.all_reduce(local, group=self.pp_group)
        return local

    def _finish(self, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        """Send the mean loss and the recorded logs from the last stage to every stage; replay the logs."""
        payload = None
        if self.holds_last_stage:
            mean = torch.stack([losses[i].float() for i in sorted(losses)]).mean()
            payload = (mean.to(self.device), self.logs.averaged(self.module, self.device))
        mean, records, _ = self.step_logs.share(payload, self.last_owner, self.pp_group, self.device)
        replay_logs(self.module, records, self.device)
        self.logs.clear()
        return mean

    def detach_gradients(self) -> list[torch.Tensor | None]:
        """Take the ``.grad`` tensors out of the parameters (they become None); returns them."""
        grads = [p.grad for p in self.parameters]
        for p in self.parameters:
            p.grad = None
        return grads

    def attach_gradients(self, grads: list[torch.Tensor | None], *, add: bool) -> None:
        """Put gradients back, or add them to what the parameters hold now."""
        for p, grad in zip(self.parameters, grads, strict=True):
            if grad is None:
                continue
            if add and p.grad is not None:
                p.grad.add_(grad)
            else:
                p.grad = grad

    def add_held_gradients(self) -> None:
        if self._held:
            self.attach_gradients(self._held, add=True)
        self._held = []

    def tied_gradient_groups(self) -> list[GradientGroup]:
        """Weights held by several stages (a tied embedding and head): their gradients are summed."""
        return [
            GradientGroup([registered_parameter(self.module, n)], g, label=f"tied weight {n}")
            for n, g in self.tied_groups.items()
        ]

    # ---- evaluation ----------------------------------------------------------------------

    def eval_step(self, step_fn: Callable[..., Any], batch: Any, step_args: Sequence[Any]) -> Any:
        """Forward-only pipeline: micro-batches flow down the stages; the last stage's outputs go to every stage."""
        size = batch_size_of(batch)
        m = math.gcd(self.micro_batches, size) if size else 1
        micro = split_batch(batch, m)
        ctx = _StepContext(step_fn, micro, tuple(step_args))
        self.logs.clear()
        chain = StageChain(self.layout.owners, self.pp_rank, self.pp_group, self.device)
        try:
            with self._running(ctx), self.logs.recording(self.module, lambda: ctx.current):
                for mb in range(m):
                    carried: Any = None
                    for stage in chain.stages:
                        carried = chain.pass_on(
                            stage, self.run_stage(stage, chain.input_of(stage, carried), mb)
                        )
            chain.wait()
            payload, outputs = None, None
            if self.holds_last_stage:
                merged = merge_outputs([ctx.outputs[i] for i in range(m)])
                outputs = None if merged is None else to_cpu(merged)  # as an object: what the step returned
                payload = (torch.zeros((), device=self.device), self.logs.averaged(self.module, self.device))
            # the logs as one device tensor; the step's outputs only when it returned some (often None)
            _, records, merged = self.eval_logs.share(
                payload, self.last_owner, self.pp_group, self.device, outputs
            )
            replay_logs(self.module, records, self.device)
        finally:
            self.logs.clear()
        return to_device(merged, self.device)
