"""What ``parallelize`` did to a module: everything the strategy's Lightning hooks need, in one object.

Lightning calls ``setup`` once per ``fit``/``validate``/``test``/``predict`` on the same module.
Sharding, cutting or wrapping it a second time would fail (its parameters are already DTensors,
its blocks already cut), so the object is kept on the module and a later strategy with the same
layout takes it back as it is (:func:`recall`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_parallel.context_parallel import ContextState
from lightning_parallel.context_parallel.local_tokens import LocalTokensMode
from lightning_parallel.memory.saved_tensors import ActivationSaver
from lightning_parallel.parallelize.experts_step import ExpertState
from lightning_parallel.parallelize.gradients import GradientReductions
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.tensor_parallel import ParallelPlan
from lightning_parallel.tensor_parallel.loss_parallel import LossParallelState

_ATTRIBUTE = "_lp_parallelized"


@dataclass
class Parallelized:
    """The result of :func:`~lightning_parallel.parallelize.parallelize` for one module on one rank."""

    layout: dict[str, int]
    """The mesh it was built for (``ParallelDims.layout``: every axis, ``ep`` included)."""
    blocks: list[str]
    """The model's repeated blocks (all of them, also those other pipeline stages hold)."""
    plan: ParallelPlan | None = None
    """The tensor-parallel plan applied (None without tensor parallelism)."""
    pipeline: PipelineRunner | None = None
    """This rank's stages and schedule (None without pipeline parallelism)."""
    experts: ExpertState = field(default_factory=ExpertState)
    """Expert parameters and the MoE auxiliary-loss collector."""
    context: ContextState | None = None
    """The context-parallel split (None without context parallelism)."""
    context_tokens: LocalTokensMode | None = None
    """Follows this rank's tokens after the last block through each training step (``context_parallel/local_tokens.py``)."""
    loss_parallel: bool = False
    """Whether the training step runs with vocabulary-sharded logits (``loss_parallel=True`` and a sharded head)."""
    loss_state: LossParallelState = field(default_factory=LossParallelState)
    """What the sharded head's hook records for the vocabulary-parallel loss."""
    activation_saver: ActivationSaver | None = None
    """Saved-activation offload/compression, entered around every training step."""
    gradients: GradientReductions = field(default_factory=GradientReductions)
    """Every gradient reduction of the layout (``parallelize/gradients.py``)."""
    norm_exclude: set[int] = field(default_factory=set)
    """Tied weights this rank leaves out of the global gradient norm (counted on another stage)."""
    hooks: list[Any] = field(default_factory=list)
    """Every hook installed on the module (they stay with it: a later entry point reuses them)."""

    def remember(self, module: nn.Module) -> None:
        object.__setattr__(module, _ATTRIBUTE, self)


def recall(module: nn.Module, layout: dict[str, int]) -> Parallelized | None:
    """An earlier setup's result for ``module`` (None if it was never parallelized); refused for another layout."""
    earlier: Parallelized | None = getattr(module, _ATTRIBUTE, None)
    if earlier is None:
        return None
    if earlier.layout != layout:
        raise ValueError(
            f"This module was already parallelized with the layout {earlier.layout}; it cannot be re-laid out as"
            f" {layout}. Create a new module (or load a checkpoint into one) for another layout."
        )
    return earlier
