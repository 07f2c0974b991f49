"""The tensor-parallel setup steps of ``HybridParallelStrategy``: build, verify and apply the plan.

Split in two because the pipeline cut happens between them: the plan is verified on the whole
model (one real step of the user's code), then applied to what this rank keeps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_parallel.pipeline.setup import filter_plan_to_kept_modules
from lightning_parallel.plans import ParallelPlan, auto_plan, plan_from_dict
from lightning_parallel.plans.report import record_parameter_shards
from lightning_parallel.strategy.pipelined import PIPELINE_BOUNDARIES_KEY
from lightning_parallel.strategy.sample import sample_step
from lightning_parallel.tensor_parallel import (
    apply_tensor_parallel,
    capture_block_inputs,
    verify_and_choose_modes,
)
from lightning_parallel.tensor_parallel.loss_parallel import install_head_hook, sharded_head_style

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer


class TensorParallelSetupMixin:
    """Plan building, verification and application (used by ``HybridParallelStrategy``)."""

    plan: ParallelPlan | None
    sequence_parallel: bool
    verify_plan: bool
    loss_parallel: bool
    _plan_arg: Any
    _loss_state: Any
    _hooks: list[Any]

    def build_plan(self, module: torch.nn.Module) -> ParallelPlan:
        tp = self.tensor_parallel  # type: ignore[attr-defined]
        sp = self.sequence_parallel and tp > 1
        if isinstance(self._plan_arg, ParallelPlan):
            return self._plan_arg
        if isinstance(self._plan_arg, dict):
            styles = {k: v for k, v in self._plan_arg.items() if k != PIPELINE_BOUNDARIES_KEY}
            return plan_from_dict(module, styles, tp, sp)
        return auto_plan(module, tp, sp)

    def _verify_tensor_parallel(self, trainer: Trainer, module: LightningModule) -> None:
        """Run one block of each class sharded and unsharded on inputs from one real step (``verify_plan``)."""
        assert self.plan is not None
        if not self.verify_plan:
            return
        firsts: dict[type, str] = {}
        for name in self.plan.block_names:
            firsts.setdefault(type(module.get_submodule(name)), name)
        blocks = {name: module.get_submodule(name) for name in firsts.values()}
        step = sample_step(trainer, self)  # type: ignore[arg-type]
        if step is None:
            rank_zero_warn("No batch available before training: the tensor-parallel plan was not verified.")
            return
        captured = capture_block_inputs(step, blocks)
        tp_mesh = self.device_mesh["tp"]  # type: ignore[attr-defined]
        for line in verify_and_choose_modes(module, self.plan, tp_mesh, captured):
            self.plan.notes.append(line)

    def _apply_tensor_parallel(self, module: LightningModule) -> None:
        """Shard what this rank holds (after the pipeline cut: styles of other stages' modules are dropped)."""
        assert self.plan is not None
        if self.dims.pp_enabled:  # type: ignore[attr-defined]
            filter_plan_to_kept_modules(self.plan, module)
        if self.loss_parallel and self.plan.head is not None:
            self.plan.styles[self.plan.head] = sharded_head_style()
        elif self.loss_parallel:
            rank_zero_warn("`loss_parallel=True`: no sharded output head was found; logits stay gathered.")
            self.loss_parallel = False
        self._hooks += apply_tensor_parallel(module, self.plan, self.device_mesh["tp"])  # type: ignore[attr-defined]
        if self.loss_parallel:
            self._hooks.append(install_head_hook(module.get_submodule(self.plan.head), self._loss_state))
        record_parameter_shards(self.plan, module)
        rank_zero_info(str(self.plan))
