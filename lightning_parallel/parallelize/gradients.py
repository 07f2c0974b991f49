"""The decided gradient reductions of a layout, installed on this rank's module and run by the strategy's hooks.

``parallelize/reductions.py`` decides them from the configuration alone; :func:`plan_gradient_reductions`
installs exactly those: DDP's reducer or FSDP2's ``replicate`` (inside backward), the explicit bucketed
groups (``data_parallel/gradient_sync.py``: during or after the last backward), nothing for DeepSpeed's
step (its engine reduces). What only the model shows is added beside them, as found, not decided: the
gradient copies of rows tensor parallelism stores on several ranks (``tensor_parallel/row_layout.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.comm.compression import BucketCompressor, register_ddp_compression
from lightning_parallel.config import ParallelConfig
from lightning_parallel.data_parallel import (
    GradientGroup,
    GradientScale,
    GradientSync,
    apply_data_parallel,
    average_direct_parameters,
    no_gradient_sync,
)
from lightning_parallel.mesh import Axis, ParallelDims
from lightning_parallel.parallelize.reductions import (
    Gradients,
    How,
    Moment,
    Reduction,
    reductions_for,
)
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.tensor_parallel.row_layout import RowCopies, stamp_row_layouts
from lightning_parallel.zero.engine_choice import Engine
from lightning_parallel.zero.fsdp import Sharded, regather
from lightning_parallel.zero.tensor_parallel import mark_model_parallel, registered_parameter


@dataclass
class GradientReductions:
    """The reductions of one layout, installed on this rank's module, as the strategy's hooks run them."""

    decided: list[Reduction] = field(default_factory=list)
    """What :func:`decide_gradient_reductions` decided from the configuration (never edited)."""
    found: list[Reduction] = field(default_factory=list)
    """What the model needs beside them (rows stored on several tensor ranks); ``describe`` prints both."""
    after_backward: GradientSync | None = None
    """The explicit reductions, once per optimizer step after the last accumulated backward."""
    in_backward: list[nn.Module] = field(default_factory=list)
    """Units of DDP's reducer / FSDP2's ``replicate``: they reduce inside backward."""
    hooks: list[Any] = field(default_factory=list)
    """Gradient hooks that average parameters registered directly on the LightningModule."""
    regather: list[nn.Module] = field(default_factory=list)
    """FSDP2 units whose updated shards are gathered after each optimizer step (ZeRO-2 under stages)."""
    fsdp_units: list[nn.Module] = field(default_factory=list)
    """Every FSDP2 unit of ZeRO on FSDP2 (empty on the other engines)."""

    def changed_after_backward(self) -> set[int]:
        """Ids of the parameters whose gradients an explicit reduction changes after backward (tied weights,
        vectors FSDP2 keeps whole): their gradients are final only then."""
        groups = self.after_backward.groups if self.after_backward is not None else []
        return {id(p) for group in groups for p in getattr(group, "parameters", [])}

    def begin_final_backward(self) -> None:
        """The next backward is the last of an optimizer step: the overlapped reductions launch during it."""
        if self.after_backward is not None:
            self.after_backward.begin_final()

    def reduce(self) -> None:
        """Run the explicit reductions (after the last backward of an optimizer step)."""
        if self.after_backward is not None:
            self.after_backward()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No reduction inside backward while Lightning accumulates gradients."""
        with no_gradient_sync(self.in_backward):
            yield

    def after_step(self) -> None:
        """After the optimizer step: ZeRO-2 on FSDP2 gathers its updated shards (whole parameters between steps)."""
        regather(self.regather)

    def gather_again(self) -> None:
        """ZeRO-2 on FSDP2, after its shards changed outside a step (a delayed update installed at a checkpoint
        or the end of fit): the whole parameters gathered anew (``unshard`` alone keeps the stale ones)."""
        for unit in self.regather:
            unit.reshard()
        regather(self.regather)

    def describe(self) -> list[str]:
        return [str(r) for r in self.decided + self.found] or ["none (one data-parallel replica)"]


def plan_gradient_reductions(
    module: nn.Module,
    config: ParallelConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    engine: Engine | None,
    runner: PipelineRunner | None,
    expert_ids: set[int],
    blocks: list[str],
    fsdp: Sharded | None = None,
) -> GradientReductions:
    """Install the decided reductions on this rank's part of the model (the recipe's last step).

    ``fsdp``: under ZeRO on FSDP2, what :func:`shard_for_zero` made (before the pipeline's stages were
    built on the sharded parameters).
    """
    decided = reductions_for(config, dims, engine)
    result = GradientReductions(decided)
    if fsdp is not None:
        dp_mesh = mesh[Axis.DP]
        whole = fsdp.whole
        if not dims.pp_enabled:  # under stages the runner reduces the units itself, once per step
            result.in_backward = fsdp.units
        result.hooks = average_direct_parameters(module, dp_mesh)
        groups: list[GradientGroup | GradientScale] = (
            list(runner.tied_gradient_groups()) if runner is not None else []
        )
        groups += [_mean(whole, dp_mesh, None, "fused biases kept whole", overlap=True)] if whole else []
        result.after_backward = _sync(groups, runner)
        result.fsdp_units = fsdp.units
        if any(r.when == Moment.AFTER_STEP for r in decided):
            result.regather = fsdp.units
        return result
    if config.zero.enabled:  # expert slices differ across ep ranks: DeepSpeed's norm counts them on each
        mark_model_parallel(p for p in _parameters(module, runner) if id(p) in expert_ids)
    if any(r.when == Moment.IN_BACKWARD for r in decided):
        dp_mesh = mesh[Axis.DP]
        result.in_backward = apply_data_parallel(module, dp_mesh, blocks, sharded_parameters=dims.tp_enabled)
        result.hooks = average_direct_parameters(module, dp_mesh)
        if decided[0].compression is not None:  # tp > 1 without stages was refused (config/validation.py)
            register_ddp_compression(result.in_backward, decided[0].compression, dp_mesh.get_group())
    explicit = [r for r in decided if r.when in (Moment.IN_LAST_BACKWARD, Moment.AFTER_BACKWARD)]
    groups = _explicit_groups(explicit, module, mesh, runner, expert_ids) if explicit else []
    result.after_backward = _sync(groups + _row_copies(module, mesh, result), runner)
    return result


def _row_copies(module: nn.Module, mesh: DeviceMesh, result: GradientReductions) -> list[RowCopies]:
    """Rows tensor parallelism stores on several ranks (k/v heads fewer than ranks): their copies' gradients are
    summed over ``tp`` after backward (``tensor_parallel/row_layout.py``). Found on the model, not decided from
    the configuration: whether a model has such rows depends on its heads."""
    duplicated = stamp_row_layouts(module)
    if not duplicated:
        return []
    result.found.append(Reduction(Gradients.SHARED_ROWS, How.SUM_OF_COPIES, Axis.TP, Moment.AFTER_BACKWARD))
    return [RowCopies(duplicated, mesh[Axis.TP].get_group())]


def _sync(groups: list[Any], runner: PipelineRunner | None) -> GradientSync | None:
    """The explicit reductions; under pipeline stages the runner opens each stage's last backward to them."""
    if not groups:
        return None
    sync = GradientSync(groups, runner.last_backward.final_calls() if runner is not None else {})
    if runner is not None:
        runner.last_backward.attach_sync(sync)
    return sync


def _parameters(module: nn.Module, runner: PipelineRunner | None) -> list[nn.Parameter]:
    """This rank's parameters in the module's registration order: the reverse of it is about the order
    backward finishes their gradients in, the order the overlapped reductions' buckets follow (as DDP's)."""
    if runner is None:
        return list(module.parameters())
    held = {id(p) for p in runner.parameters}
    return [p for p in module.parameters() if id(p) in held]


def _explicit_groups(
    decided: list[Reduction],
    module: nn.Module,
    mesh: DeviceMesh,
    runner: PipelineRunner | None,
    expert_ids: set[int],
) -> list[GradientGroup | GradientScale]:
    """The bucketed all-reduces (and scalings) of the reductions after backward, on this rank's parameters."""
    trainable = [p for p in _parameters(module, runner) if p.requires_grad]
    dense = [p for p in trainable if id(p) not in expert_ids]
    experts = [p for p in trainable if id(p) in expert_ids]
    tied = {id(registered_parameter(module, n)) for n in runner.tied_groups} if runner is not None else set()
    compression = next((r.compression for r in decided if r.compression is not None), None)
    compressor = BucketCompressor(compression) if compression is not None else None
    dp = mesh[Axis.DP]
    groups: list[GradientGroup | GradientScale] = []
    for r in decided:
        overlap = r.when == Moment.IN_LAST_BACKWARD
        if (r.gradients, r.axis) == (Gradients.TIED, Axis.PP):
            assert runner is not None
            groups += runner.tied_gradient_groups()
        elif r.gradients == Gradients.DENSE and r.axis == Axis.EP:
            ep = mesh[Axis.EP]
            groups.append(
                GradientGroup(dense, ep.get_group(), ep.size(), label="dense mean over ep", overlap=overlap)
            )
        elif r.gradients == Gradients.EXPERTS and r.how == How.DIVIDED_BY_EP:
            groups.append(GradientScale(experts, mesh[Axis.EP].size(), label="experts"))
        elif r.gradients == Gradients.DENSE or (r.gradients == Gradients.DENSE_BUT_TIED and not tied):
            groups.append(_mean(dense, dp, compressor, "data-parallel mean", overlap=overlap))
        elif r.gradients == Gradients.DENSE_BUT_TIED:
            groups.append(
                _mean([p for p in dense if id(p) not in tied], dp, compressor, "data-parallel mean")
            )
        elif (r.gradients, r.axis) == (Gradients.TIED, Axis.DP):
            if tied:  # this rank holds a tied weight: its mean uncompressed (the split above)
                groups.append(
                    _mean(
                        [p for p in dense if id(p) in tied],
                        dp,
                        None,
                        "tied weights, uncompressed",
                        overlap=overlap,
                    )
                )
        elif r.gradients == Gradients.EXPERTS and experts:
            replicas = mesh[Axis.DP_REPLICATE].get_group()
            groups.append(
                GradientGroup(
                    experts, replicas, dp.size(), label="experts over their replicas", overlap=overlap
                )
            )
    return groups


def _mean(
    params: list[nn.Parameter],
    dp: DeviceMesh,
    compressor: BucketCompressor | None,
    label: str,
    *,
    overlap: bool = False,
) -> GradientGroup:
    group = GradientGroup(params, dp.get_group(), dp.size(), label=label)
    if compressor is not None and group.is_mean:  # never the sums of tied weights, nor expert reductions
        group.compressor = compressor
    group.overlap = overlap and group.compressor is None
    return group
