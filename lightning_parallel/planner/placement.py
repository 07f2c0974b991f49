"""Where each parameter's elements live: the pipeline stages holding it, its shard on each tensor-parallel rank,
and what FSDP2 leaves of it on each data-parallel rank, by the rules the strategy applies at setup.

The pipeline cut is the strategy's own (``pipeline/setup.py: split_stages``: blocks by the balanced cut, what
precedes the first block on stage 0, what follows the last on the last stage, a tied head on both); a tensor
rank keeps what the plan's styles keep (``plans/auto.py``, split like ``torch.chunk``); FSDP2 shards a tensor
on its first dimension tensor parallelism does not cut (``zero/fsdp.py``). ``planner/memory.py`` adds the
bytes up per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from lightning_parallel.config.arguments import pipeline
from lightning_parallel.experts import find_moe_blocks
from lightning_parallel.pipeline.setup import split_stages
from lightning_parallel.planner.layout import Layout
from lightning_parallel.plans import auto_plan
from lightning_parallel.plans.detect import block_names
from lightning_parallel.tensor_parallel.styles import sharded_dims

__all__ = ["ParameterPlacement", "chunk_sizes", "fsdp_local_elements", "parameter_placements", "stage_split"]


@dataclass(frozen=True)
class ParameterPlacement:
    """One parameter: its elements on each tensor-parallel rank, the stages that hold it, expert or not."""

    name: str
    shape: tuple[int, ...]
    tp_local: tuple[tuple[int, ...], ...]
    """Local shape on tensor-parallel rank 0, 1, ... (the whole shape when it is not sharded)."""
    tp_dim: int | None
    stages: frozenset[int]
    expert: bool


def chunk_sizes(size: int, parts: int) -> list[int]:
    """Sizes ``torch.chunk`` (and DTensor's ``Shard``) gives ``parts`` ranks: ceil-sized, the last ones short."""
    step = math.ceil(size / parts) if size else 0
    return [max(0, min(step, size - i * step)) for i in range(parts)]


def _tp_shapes(
    shape: tuple[int, ...], dim: int | None, tp: int, num_chunks: int
) -> tuple[tuple[int, ...], ...]:
    if dim is None or tp == 1:
        return (shape,) * tp
    size = shape[dim]
    if num_chunks > 1 and size % num_chunks == 0:  # a fused weight (q|k|v, gate|up): each part split alike
        locals_ = [num_chunks * c for c in chunk_sizes(size // num_chunks, tp)]
    else:
        locals_ = chunk_sizes(size, tp)
    return tuple(shape[:dim] + (n,) + shape[dim + 1 :] for n in locals_)


def parameter_placements(
    model: nn.Module, layout: Layout, stage_of_block: list[int]
) -> list[ParameterPlacement]:
    """Every parameter once (tied ones under their first name), with the stages holding it."""
    tp = layout.tensor_parallel
    plan = auto_plan(model, tp, sequence_parallel=layout.sequence_parallel) if tp > 1 else None
    modules = dict(model.named_modules())
    names = block_names(model)
    block_of = {id(p): i for i, b in enumerate(names) for p in model.get_submodule(b).parameters()}
    experts = {n for info in find_moe_blocks(model) for n in info.expert_param_names}
    last = max(stage_of_block) if stage_of_block else 0
    canonical = {id(p): n for n, p in model.named_parameters()}
    stages: dict[str, set[int]] = {}
    seen_block = False
    for _name, param in model.named_parameters(remove_duplicate=False):
        first = canonical[id(param)]
        if id(param) in block_of:
            seen_block = True
            stages.setdefault(first, set()).add(stage_of_block[block_of[id(param)]])
        else:  # before the blocks: stage 0; after them: the last stage (a tied head: both)
            stages.setdefault(first, set()).add(last if seen_block else 0)
    out = []
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        style = plan.styles.get(owner) if plan is not None else None
        dim = sharded_dims(modules[owner], style).get(attr) if style is not None else None
        rows = getattr(style, "row_layout", None)
        # rows in another order, some on several ranks (few k/v heads)
        if rows is not None and dim is not None:
            local = (tuple(param.shape[:dim]) + (rows.per_rank,) + tuple(param.shape[dim + 1 :]),) * tp
        else:
            local = _tp_shapes(tuple(param.shape), dim, tp, getattr(style, "num_chunks", 1))
        out.append(
            ParameterPlacement(
                name,
                tuple(param.shape),
                local,
                dim if tp > 1 else None,
                frozenset(stages[name]),
                name in experts,
            )
        )
    return out


def stage_split(model: nn.Module, layout: Layout) -> tuple[list[int], list[range], list[int]]:
    """(stage of each block, blocks of each stage, pipeline rank of each stage), as the strategy cuts."""
    if layout.pipeline_parallel == 1:
        n = len(block_names(model))
        return [0] * n, [range(n)], [0]

    config = pipeline(
        layout.pipeline_parallel,
        layout.micro_batches,
        layout.pipeline_schedule,
        layout.pipeline_virtual_stages if layout.pipeline_virtual_stages > 1 else None,
        None,
    )
    assert config is not None
    split = split_stages(model, config)
    stage_of = [0] * len(split.block_names)
    for stage, blocks in enumerate(split.ranges):
        for i in blocks:
            stage_of[i] = stage
    return stage_of, split.ranges, split.owners


def fsdp_local_elements(numel: int, shape: tuple[int, ...], tp_dim: int | None, dp: int, dp_rank: int) -> int:
    """Elements FSDP2 leaves on ``dp_rank`` of a tensor with ``numel`` local elements of (tp-local) ``shape``:
    split on the first dim tensor parallelism does not cut; a vector it cuts stays whole
    (``zero/fsdp.py: shard_placement, unsharded_parameters``)."""
    if not shape:
        return numel
    if len(shape) == 1 and tp_dim is not None:
        return numel
    dim = next((d for d in range(len(shape)) if d != tp_dim), 0)
    return chunk_sizes(shape[dim], dp)[dp_rank] * (numel // shape[dim])
