"""``plan={pattern: style}``: a user-controlled plan, checked against the model.

Patterns are ``fnmatch`` patterns over module names (``"transformer.h.*.attn.c_attn"``).
Values are torch ``ParallelStyle`` objects or the short names below. Containers (a module
with column-parallel children and one row-parallel child) get the same head-count and width
rewriting as the automatic plan, and the same verification at setup.
"""

from __future__ import annotations

import difflib
import fnmatch

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from lightning_parallel.plans.auto import exit_style, scaled_attributes
from lightning_parallel.plans.detect import find_block_stack, head_count, head_dim_of, join, kv_head_count
from lightning_parallel.tensor_parallel.norm_styles import ResidualNorm
from lightning_parallel.tensor_parallel.plan import ParallelPlan, ShardedContainer
from lightning_parallel.tensor_parallel.styles import (
    ColwiseProjection,
    TokenEmbedding,
    is_projection,
    projection_dims,
)

STYLE_NAMES = (
    "colwise",
    "rowwise",
    "fused_qkv",
    "fused_gate_up",
    "embedding",
    "head",
    "sequence_parallel",
    "replicate",
)


def style_from_name(name: str, *, sequence_parallel: bool) -> ParallelStyle | None:
    if name == "colwise":
        return ColwiseProjection(use_local_output=True)
    if name == "fused_qkv":
        return ColwiseProjection(num_chunks=3, use_local_output=True)
    if name == "fused_gate_up":
        return ColwiseProjection(num_chunks=2, use_local_output=True)
    if name == "rowwise":
        return exit_style(sequence_parallel=sequence_parallel)
    if name == "embedding":
        return TokenEmbedding(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "head":
        return ColwiseProjection(output_layouts=Replicate(), use_local_output=True)
    if name == "sequence_parallel":
        return ResidualNorm()
    if name == "replicate":
        return None
    raise ValueError(f"Unknown style {name!r} in `plan=`; use a ParallelStyle or one of {STYLE_NAMES}.")


def _is_colwise(style: ParallelStyle) -> bool:
    return isinstance(style, ColwiseProjection) and style.output_layouts[0] != Replicate()


def _is_rowwise(style: ParallelStyle) -> bool:
    return isinstance(style, RowwiseParallel) and style.input_layouts[0] == Shard(-1)


def plan_from_dict(
    model: nn.Module,
    patterns: dict[str, ParallelStyle | str],
    tensor_parallel: int,
    *,
    sequence_parallel: bool,
) -> ParallelPlan:
    """Resolve patterns to module names; every pattern must match at least one module."""
    names = [name for name, _ in model.named_modules() if name]
    plan = ParallelPlan(tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel)
    for pattern, value in patterns.items():
        matches = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matches:
            close = difflib.get_close_matches(pattern, names, n=3)
            hint = f" Did you mean {close}?" if close else ""
            raise ValueError(f"`plan` pattern {pattern!r} matches no module of {type(model).__name__}.{hint}")
        style = (
            style_from_name(value, sequence_parallel=sequence_parallel) if isinstance(value, str) else value
        )
        for name in matches:
            if style is None:
                plan.styles.pop(name, None)
            else:
                plan.styles[name] = style
    stack = find_block_stack(model)
    if stack is not None:
        plan.block_list = stack.name
        plan.block_names = stack.names
    _infer_containers(model, plan)
    return plan


def _infer_containers(model: nn.Module, plan: ParallelPlan) -> None:
    tp = plan.tensor_parallel
    for name, module in model.named_modules():
        children = [(join(name, n), c) for n, c in module.named_children() if is_projection(c)]
        entries = [(n, c) for n, c in children if n in plan.styles and _is_colwise(plan.styles[n])]
        exits = [(n, c) for n, c in children if n in plan.styles and _is_rowwise(plan.styles[n])]
        if not entries or len(exits) != 1:
            continue
        exit_in, hidden = projection_dims(exits[0][1])
        heads = head_count(module) or (exit_in // head_dim_of(module) if head_dim_of(module) else None)
        known: dict = {"widths": {hidden, exit_in, 3 * exit_in}}
        if heads is not None:
            if heads % tp:
                raise ValueError(f"`tensor_parallel={tp}` does not divide the {heads} heads of `{name}`.")
            known["heads"] = heads
            known["kv_heads"] = kv_head_count(module) or heads
        plan.containers.append(
            ShardedContainer(
                name=name,
                kind="attention" if heads is not None else "mlp",
                entries=[n for n, _ in entries],
                exit=exits[0][0],
                scaled_attributes=scaled_attributes(module, tp, known),
                hidden_size=hidden,
            )
        )
