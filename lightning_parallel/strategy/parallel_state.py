"""What ``setup`` did to a module, kept on the module so the next Trainer entry point reuses it.

Lightning calls ``setup`` once per ``fit``/``validate``/``test``/``predict`` on the same module.
Sharding, cutting or wrapping it a second time would fail (its parameters are already
DTensors, its blocks already cut), so the first setup's results are stored on the module and
a later strategy takes them back as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

# The strategy attributes the setup steps fill (plan, pipeline, experts, gradient reduction, hooks).
RESTORED_ATTRIBUTES = (
    "plan",
    "pipeline_runner",
    "loss_parallel",
    "_dp_units",
    "_hooks",
    "_manual_gradient_sync",
    "_expert_parameter_ids",
    "_aux_losses",
    "_gradient_sync",
)
_ATTRIBUTE = "_lp_parallel_state"


@dataclass
class ParallelState:
    degrees: dict[str, int]
    attributes: dict[str, Any]
    norm_exclude: set[int]  # the precision plugin's: tied weights counted once in the gradient norm


def remember(strategy: Any, module: nn.Module) -> None:
    state = ParallelState(
        dict(strategy.dims.degrees),
        {name: getattr(strategy, name, None) for name in RESTORED_ATTRIBUTES},
        getattr(strategy.precision_plugin, "norm_exclude", set()),
    )
    object.__setattr__(module, _ATTRIBUTE, state)


def restore(strategy: Any, module: nn.Module) -> bool:
    """Take back an earlier setup's results; False if the module was never parallelized."""
    state: ParallelState | None = getattr(module, _ATTRIBUTE, None)
    if state is None:
        return False
    if state.degrees != strategy.dims.degrees:
        raise ValueError(
            f"This module was already parallelized with the layout {state.degrees}; it cannot be re-laid out as"
            f" {strategy.dims.degrees}. Create a new module (or load a checkpoint into one) for another layout."
        )
    for name, value in state.attributes.items():
        setattr(strategy, name, value)
    if hasattr(strategy.precision_plugin, "norm_exclude"):
        strategy.precision_plugin.norm_exclude = state.norm_exclude
    return True
