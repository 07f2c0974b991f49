"""Pipeline parallelism in the recipe: learn the stages from the sampled step, cut, build the runner.

Under pipeline parallelism the Trainer's step does forward *and* backward (torch's schedule
interleaves them over micro-batches), so Lightning's backward only runs the hooks around the
gradients the schedule produced (``strategy/pipelined.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.mesh import Axis
from lightning_parallel.pipeline.discover import DiscoveryProbe
from lightning_parallel.pipeline.microbatch import check_divisible
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.pipeline.schedules import ideal_efficiency
from lightning_parallel.pipeline.setup import (
    PipelineConfig,
    StageSplit,
    cut_for_rank,
    norm_duplicates,
    plan_stages,
    split_stages,
    tied_weight_groups,
)
from lightning_parallel.pipeline.stages import StageLayout, StageRuntime

NO_DATA = (
    "Pipeline parallelism reads one batch at setup to learn how your step calls the model, but no"
    " dataloader was available. Pass the data to `trainer.fit(...)` (or a datamodule)."
)


@dataclass
class StageCut:
    """This rank's part of the cut model: its stages, the weights it owns, the hooks' shared state."""

    layout: StageLayout
    my_stages: list[int]
    owned: set[str]
    runtime: StageRuntime


def discovery_probe(
    module: nn.Module, config: PipelineConfig, batch: Any, *, training: bool
) -> tuple[StageSplit, DiscoveryProbe]:
    """The stage split (from the model alone) and the probe that learns the rest from the sampled step."""
    if training:
        check_divisible(batch, config.micro_batches)
    split = split_stages(module, config)
    return split, DiscoveryProbe(module, split.block_names, training=training)


def cut_pipeline(
    module: nn.Module, layout: StageLayout, config: PipelineConfig, mesh: DeviceMesh
) -> StageCut:
    """Replace the blocks and weights other pipeline ranks hold (``pipeline/stages.py``)."""
    runtime = StageRuntime()
    my_stages, owned = cut_for_rank(module, layout, config, mesh[Axis.PP].get_local_rank(), runtime)
    return StageCut(layout, my_stages, owned, runtime)


def build_runner(
    module: nn.Module,
    cut: StageCut,
    config: PipelineConfig,
    mesh: DeviceMesh,
    device: torch.device,
    aux_losses: Any,
    fsdp_units: list[nn.Module],
    fsdp_before_schedule: Any = None,
) -> tuple[PipelineRunner, set[int]]:
    """torch's stages and schedule over this rank's cut; also the tied weights left out of the gradient norm."""
    runner = PipelineRunner(
        module,
        cut.layout,
        config.spec,
        cut.my_stages,
        config.micro_batches,
        mesh[Axis.PP].get_group(),
        device,
        cut.runtime,
        cut.owned,
        tied_weight_groups(cut.layout, mesh),
        aux_collector=aux_losses,
        fsdp_units=fsdp_units,
        fsdp_before_schedule=fsdp_before_schedule,
    )
    norm_exclude = norm_duplicates(cut.layout, mesh[Axis.PP].get_local_rank(), module)
    ranges = ", ".join(
        f"stage {s} (rank {cut.layout.owners[s]}): blocks {r.start}-{r.stop - 1}"
        for s, r in enumerate(cut.layout.ranges)
    )
    ideal = ideal_efficiency(
        config.spec, config.micro_batches, config.pipeline_parallel, config.virtual_stages
    )
    rank_zero_info(
        f"Pipeline: {config.spec.name}, {config.micro_batches} micro-batches, {ranges}; ideal efficiency {ideal:.2f}"
    )
    return runner, norm_exclude


__all__ = ["NO_DATA", "StageCut", "build_runner", "cut_pipeline", "discovery_probe", "plan_stages"]
