"""The ways a block's sharded containers can be run, plainest first: what the verification
(``verify.py``) tries on one block of each kind until one reproduces the unsharded block, and then keeps
for every block of that kind.

A mode is a choice per container: full-width or width-sliced attention input, which layout of a fused
entry, per-head tensors cut to the rank's heads or not, and whether outputs the model changes in place are
copied first (the exit's; the entries' too).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate

from lightning_parallel.tensor_parallel.block_kinds import same_kind
from lightning_parallel.tensor_parallel.plan import ParallelPlan, ShardedContainer

__all__ = ["Mode", "keep_mode", "modes_to_try", "relative_plan"]


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way to run a block's sharded containers, as the verification tries them."""

    narrow: bool = False  # attention shown a width-sliced input
    variant: int = 0  # the fused entries' layout (``ShardedContainer.variants``)
    slice_heads: bool = False  # per-head tensors handed to attention cut to the local heads
    copy_output: bool = False  # the exits' outputs copied (for models that add to them in place)
    copy_entry_outputs: bool = False  # the entries' outputs copied too (for models that change them in place)
    # the MLPs' hidden units gathered after the entries, cut again at the exit: code reducing over them (a
    # statistic over the hidden units) sees every rank's
    inner_gathered: bool = False

    def describe(self, containers: list[ShardedContainer]) -> str:
        words = ["width-sliced" if self.narrow else "full-width"]
        labels = {
            c.variants[min(self.variant, len(c.variants) - 1)].description for c in containers if c.variants
        }
        words += sorted(label for label in labels if label)
        words += ["per-head inputs cut to its heads"] if self.slice_heads else []
        words += ["outputs copied"] if self.copy_output else []
        words += ["entry outputs copied"] if self.copy_entry_outputs else []
        return ", ".join(words + (["MLP hidden units gathered"] if self.inner_gathered else []))


def modes_to_try(containers: list[ShardedContainer]) -> list[Mode]:
    """Every mode a block's containers allow, the plainest first."""
    attention = any(c.kind == "attention" for c in containers)
    variants = max((len(c.variants) for c in containers), default=0) or 1
    both = (False, True) if attention else (False,)
    copies = [(False, False), (True, False), (True, True)]
    # last: an MLP whose own code reduces over its hidden units (Gemma 3n's activation sparsity)
    inner = (False, True) if any(c.kind == "mlp" for c in containers) else (False,)
    return [
        Mode(n, v, h, c, e, i)
        for i in inner
        for c, e in copies
        for h in both
        for v in range(variants)
        for n in both
    ]


def _apply_mode(container: ShardedContainer, mode: Mode) -> ShardedContainer:
    attention = container.kind == "attention"
    variant = min(mode.variant, len(container.variants) - 1) if container.variants else 0
    scaled = container.variants[variant].scaled_attributes if container.variants else None
    return dataclasses.replace(
        container,
        scaled_attributes={**container.scaled_attributes, **(scaled or {})},
        narrow_input=mode.narrow and attention,
        variant=variant,
        slice_heads=mode.slice_heads and attention,
        copy_output=mode.copy_output,
        copy_entry_outputs=mode.copy_entry_outputs,
        inner_gathered=mode.inner_gathered and container.kind == "mlp",
    )


def _variant_styles(container: ShardedContainer, styles: dict[str, Any]) -> dict[str, Any]:
    """The container's entry styles as its variant and mode make them (``styles``: the plan's so far)."""
    chosen = dict(container.variants[container.variant].styles) if container.variants else {}
    if container.inner_gathered:  # the entries' outputs all-gathered, the exit's input cut to this rank's
        for entry in container.entries:
            style = copy.copy(chosen.get(entry, styles.get(entry)))
            style.output_layouts = (Replicate(),)
            chosen[entry] = style
        exit_style = copy.copy(chosen.get(container.exit, styles.get(container.exit)))
        exit_style.input_layouts = (Replicate(),)
        chosen[container.exit] = exit_style
    return chosen


def relative_plan(plan: ParallelPlan, prefix: str, mode: Mode) -> ParallelPlan:
    """The part of ``plan`` inside block ``prefix``, named from the block, the block its own block stack
    (``""``): ``apply_tensor_parallel`` shards a copy of the block with it as it shards the model."""
    cut = len(prefix) + 1
    # the block's own container too (OPT's fc1 and fc2 are the block's): what runs is what is verified
    chosen = [
        _apply_mode(c, mode) for c in plan.containers if c.name == prefix or c.name.startswith(prefix + ".")
    ]
    styles = dict(plan.styles)
    for container in chosen:
        styles.update(_variant_styles(container, styles))
    # the block's own style (its parameters' gradients summed over tp under sequence parallelism) under ""
    styles = {
        name[cut:]: style for name, style in styles.items() if name == prefix or name.startswith(prefix + ".")
    }
    containers = [
        dataclasses.replace(c, name=c.name[cut:], entries=[e[cut:] for e in c.entries], exit=c.exit[cut:])
        for c in chosen
    ]
    whole = [n[cut:] for n in plan.whole_sequence if n.startswith(prefix + ".")]
    return dataclasses.replace(
        plan, styles=styles, containers=containers, block_names=[""], norms=[], whole_sequence=whole
    )


def keep_mode(plan: ParallelPlan, model: nn.Module, block: nn.Module, mode: Mode) -> None:
    """Every block of ``block``'s kind runs its containers in ``mode`` (their fused entries' styles too)."""
    for index, container in enumerate(plan.containers):
        owner = next(
            (b for b in plan.block_names if container.name == b or container.name.startswith(b + ".")), None
        )
        if owner is not None and same_kind(model.get_submodule(owner), block):
            chosen = _apply_mode(container, mode)
            plan.containers[index] = chosen
            plan.styles.update(_variant_styles(chosen, plan.styles))
