"""Build one rank's pipeline: find the blocks, cut the stages, make the groups, pick the schedule.

Called by the strategy at setup, on every rank alike (every decision depends only on the
model, the first batch and the layout, which all ranks share), so a bad configuration fails
everywhere with the same ``ValueError`` before any pipeline communication starts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.mesh import Axis
from lightning_parallel.pipeline.discover import WEIGHTS, Discovery, PipelineSetupError, handed_on
from lightning_parallel.pipeline.schedules import ScheduleSpec, stage_owner, stages_of_rank
from lightning_parallel.pipeline.split import balanced_boundaries, check_user_boundaries, stage_ranges
from lightning_parallel.pipeline.stages import SkippedBlock, StageLayout, StageRuntime, cut_into_stages
from lightning_parallel.plans.detect import block_names
from lightning_parallel.zero.tensor_parallel import registered_parameter


@dataclass(frozen=True)
class PipelineConfig:
    """The strategy's pipeline arguments, resolved (``config/validation.py`` checks them)."""

    pipeline_parallel: int
    """Pipeline ranks (``pipeline_parallel=``)."""
    spec: ScheduleSpec
    """The schedule (``pipeline_schedule=``), as torch's class and its stage placement."""
    virtual_stages: int
    """Stages per rank: 1, or more for the interleaved and V schedules (``pipeline_virtual_stages=``)."""
    micro_batches: int
    """Micro-batches per batch (``micro_batches=``; default: pipeline ranks x stages per rank)."""
    boundaries: tuple[int, ...] | None = None
    """First block of stages 1..S-1 (``plan={"pipeline_boundaries": [...]}``); None: balanced."""

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel * self.virtual_stages


def find_block_names(module: nn.Module) -> list[str]:
    """The blocks the pipeline cuts between (``plans.detect.block_names``); a clear error without any."""
    names = block_names(module)
    if not names:
        raise ValueError(
            f"Pipeline parallelism cuts the model between its repeated blocks, but no block list (an"
            f" nn.ModuleList of same-class modules) was found in {type(module).__name__}."
        )
    return names


@dataclass(frozen=True)
class StageSplit:
    """Which blocks each stage holds and which pipeline rank holds each stage: decided from the model
    and the configuration alone (the ``plan`` command prints it without processes)."""

    block_names: list[str]
    block_costs: list[int]
    ranges: list[range]
    owners: list[int]
    user_boundaries: bool = False
    """The boundaries came from ``plan={"pipeline_boundaries": ...}`` (never moved: refused where they cut state)."""


def split_stages(module: nn.Module, config: PipelineConfig) -> StageSplit:
    names = find_block_names(module)
    costs = [sum(p.numel() for p in module.get_submodule(b).parameters()) for b in names]
    if config.boundaries is not None:
        starts = check_user_boundaries(list(config.boundaries), len(names), config.num_stages)
    else:
        starts = balanced_boundaries(costs, config.num_stages)
    owners = [stage_owner(config.spec, s, config.pipeline_parallel) for s in range(config.num_stages)]
    return StageSplit(names, costs, stage_ranges(starts, len(names)), owners, config.boundaries is not None)


def plan_stages(module: nn.Module, split: StageSplit, discovery: Discovery) -> StageLayout:
    """The stage layout: the split, and what one real step (``discovery``) showed about the model."""
    split = keep_handed_state_within_stages(split, discovery.handed)
    return StageLayout.build(module, split.ranges, split.owners, discovery)


def keep_handed_state_within_stages(split: StageSplit, handed: dict[tuple[int, int], str]) -> StageSplit:
    """The split moved so that no stage boundary separates two blocks that hand state to each other besides the
    hidden state (``handed_state.py``); a ``PipelineSetupError`` naming them where no split can."""
    forbidden = {start for earlier, later in handed for start in range(earlier + 1, later + 1)}
    starts = [r.start for r in split.ranges]
    crossed = [pair for pair in handed if any(pair[0] < b <= pair[1] for b in starts[1:])]
    if not crossed:
        return split
    earlier, later = crossed[0]
    argument = handed[(earlier, later)]
    what = (
        f"`{argument}`, written or returned by block {split.block_names[earlier]}"
        if argument != WEIGHTS
        else f"a tensor computed from the weights of block {split.block_names[earlier]}"
    )
    refusal = handed_on(split.block_names[later], what)
    if split.user_boundaries:
        raise PipelineSetupError(
            f"{refusal} Or move the boundary: `pipeline_boundaries` puts one between blocks {earlier} and {later}."
        )
    try:
        starts = balanced_boundaries(split.block_costs, len(split.ranges), forbidden)
    except ValueError:
        raise PipelineSetupError(
            f"{refusal} No split into {len(split.ranges)} stages keeps every such pair of blocks on one stage."
        ) from None
    moved = replace(split, ranges=stage_ranges(starts, len(split.block_names)))
    rank_zero_info(
        f"Pipeline: stage boundaries moved to blocks {starts[1:]} (were {[r.start for r in split.ranges][1:]}):"
        f" blocks {sorted(handed)} hand state besides the hidden state, kept on one stage"
    )
    return moved


def cut_for_rank(
    module: nn.Module, layout: StageLayout, config: PipelineConfig, pp_rank: int, runtime: StageRuntime
) -> tuple[list[int], set[str]]:
    my_stages = stages_of_rank(config.spec, pp_rank, config.pipeline_parallel, config.virtual_stages)
    owned = cut_into_stages(module, layout, my_stages, runtime)
    return my_stages, owned


def tied_weight_groups(layout: StageLayout, mesh: DeviceMesh) -> dict[str, dist.ProcessGroup]:
    """A process group per weight held on several pipeline ranks (GPT's embedding and head), under this rank's
    name for it.

    Every rank creates every group in the same order (``new_group`` is collective over the
    world); each keeps the one its own (dp, tp) position belongs to.
    """
    tied = layout.tied_across_ranks()
    if not tied:
        return {}
    pp_size, tp_size = mesh[Axis.PP].size(), mesh[Axis.TP].size()
    grid = mesh.mesh.reshape(pp_size, -1, tp_size)  # (pp, dp, tp) global ranks (dp flattened under ep)
    me = dist.get_rank()
    by_ranks: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for ranks in sorted(set(tied.values())):
        if len(ranks) == grid.size(0):
            by_ranks[ranks] = mesh[Axis.PP].get_group()
            continue
        mine = None
        for d in range(grid.size(1)):
            for t in range(grid.size(2)):
                members = [int(grid[r, d, t]) for r in ranks]
                group = dist.new_group(members)
                if me in members:
                    mine = group
        by_ranks[ranks] = mine
    pp_rank = mesh[Axis.PP].get_local_rank()
    return {
        layout.name_on_rank(name, pp_rank): by_ranks[ranks]
        for name, ranks in tied.items()
        if pp_rank in ranks and by_ranks[ranks] is not None
    }


def norm_duplicates(layout: StageLayout, pp_rank: int, module: nn.Module) -> set[int]:
    """Ids of tied weights this rank must leave out of the global gradient norm (counted on their first rank)."""
    out = set()
    for name, ranks in layout.tied_across_ranks().items():
        if pp_rank in ranks and pp_rank != ranks[0]:  # middle stages of 3+ do not hold it at all
            out.add(id(registered_parameter(module, layout.name_on_rank(name, pp_rank))))
    return out


def filter_plan_to_kept_modules(plan: Any, module: nn.Module) -> Any:
    """Drop tensor-parallel styles for modules another stage holds (they have no parameters here)."""

    def kept(name: str) -> bool:
        try:
            target = module.get_submodule(name)
        except AttributeError:
            return False
        if isinstance(target, SkippedBlock):
            return False
        return any(True for _ in target.parameters())

    plan.styles = {name: style for name, style in plan.styles.items() if kept(name)}
    plan.containers = [c for c in plan.containers if kept(c.name)]
    plan.whole_sequence = [n for n in plan.whole_sequence if kept(n)]
    if plan.head is not None and not kept(plan.head):
        plan.head = None
    return plan


__all__ = [
    "PipelineConfig",
    "StageSplit",
    "cut_for_rank",
    "filter_plan_to_kept_modules",
    "find_block_names",
    "norm_duplicates",
    "plan_stages",
    "split_stages",
    "tied_weight_groups",
]
