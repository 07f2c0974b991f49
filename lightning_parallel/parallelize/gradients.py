"""Every gradient reduction of a layout, decided in one function from the configuration.

:func:`plan_gradient_reductions` is the one place that says which gradients are averaged or
summed over which ranks, scaled by what, compressed or not, and when; nothing edits its result
afterwards. Three kinds of reduction exist, and a layout uses what it needs:

- inside backward: DDP's reducer or FSDP2's ``replicate`` over ``dp`` (data parallelism, with or
  without tensor parallelism), paused while gradients accumulate;
- after the last backward of an optimizer step: explicit bucketed all-reduces
  (``data_parallel/gradient_sync.py``) where hooks cannot express the reduction: pipeline
  schedules (backward per micro-batch; tied weights summed across stages), sharded experts
  (expert weights over their replicas only);
- in the optimizer step: DeepSpeed's ZeRO engine over the (expert-)data-parallel ranks, after the
  explicit part that must come first (tied weights, the dense gradients' mean over ``ep``).

``describe()`` lists them in the order they run: the setup log prints it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.comm.compression import BucketCompressor, PowerSGD, register_ddp_compression
from lightning_parallel.config import ParallelConfig
from lightning_parallel.data_parallel import (
    GradientGroup,
    GradientScale,
    GradientSync,
    apply_data_parallel,
    average_direct_parameters,
    no_gradient_sync,
)
from lightning_parallel.mesh import ParallelDims
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.zero.tensor_parallel import local_shard_parameters, mark_model_parallel


@dataclass
class GradientReductions:
    """The reductions of one layout (see the module docstring), as the strategy's hooks run them."""

    after_backward: GradientSync | None = None
    """Explicit reductions, once per optimizer step after the last accumulated backward."""
    in_backward: list[nn.Module] = field(default_factory=list)
    """Units of DDP's reducer / FSDP2's ``replicate``: they reduce inside backward."""
    hooks: list[Any] = field(default_factory=list)
    """Gradient hooks that average parameters registered directly on the LightningModule."""
    in_optimizer_step: str | None = None
    """What reduces inside the optimizer step (ZeRO), for ``describe``."""

    def reduce(self) -> None:
        """Run the explicit reductions (after the last backward of an optimizer step)."""
        if self.after_backward is not None:
            self.after_backward()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No reduction inside backward while Lightning accumulates gradients."""
        with no_gradient_sync(self.in_backward):
            yield

    def describe(self) -> list[str]:
        lines = []
        if self.in_backward:
            lines.append(f"inside backward: mean over dp by {len(self.in_backward)} replicated unit(s)")
        if self.hooks:
            lines.append(
                f"inside backward: mean over dp of {len(self.hooks)} parameter(s) of the LightningModule"
            )
        if self.after_backward is not None:
            lines += [f"after backward: {line}" for line in self.after_backward.describe()]
        if self.in_optimizer_step is not None:
            lines.append(f"in the optimizer step: {self.in_optimizer_step}")
        return lines or ["none (one data-parallel replica)"]


def plan_gradient_reductions(
    module: nn.Module,
    config: ParallelConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    runner: PipelineRunner | None,
    expert_ids: set[int],
    blocks: list[str],
) -> GradientReductions:
    """Decide (and install) every gradient reduction of the layout; the last step of the recipe but ``init_weights``."""
    if config.zero.enabled:
        return _under_zero(module, dims, mesh, runner, expert_ids)
    compression = config.memory.gradient_compression if dims.dp_enabled else None
    compressor = BucketCompressor(compression) if compression is not None else None
    if runner is not None:
        groups = runner.tied_gradient_groups() + _compressed(
            _data_parallel_groups(runner.parameters, expert_ids, mesh), compressor
        )
        if isinstance(compression, PowerSGD):
            groups = _tied_weights_uncompressed(
                groups, {id(module.get_parameter(n)) for n in runner.tied_groups}
            )
        return GradientReductions(after_backward=GradientSync(groups))
    if dims.ep_enabled:
        params = [p for p in module.parameters() if p.requires_grad]
        return GradientReductions(
            after_backward=GradientSync(
                _compressed(_data_parallel_groups(params, expert_ids, mesh), compressor)
            )
        )
    if not dims.dp_enabled:
        return GradientReductions()
    dp_mesh = mesh["dp"]
    units = apply_data_parallel(module, dp_mesh, blocks, sharded_parameters=dims.tp_enabled)
    if (
        compression is not None
    ):  # tensor parallelism without pipeline stages was refused (config/validation.py)
        register_ddp_compression(units, compression, dp_mesh.get_group())
    return GradientReductions(in_backward=units, hooks=average_direct_parameters(module, dp_mesh))


def _data_parallel_groups(
    parameters: list[nn.Parameter], expert_ids: set[int], mesh: DeviceMesh
) -> list[GradientGroup]:
    """Means over ``dp``; an expert weight's gradient already holds its ep group's tokens, so it is *summed*
    over its replicas (``dp_replicate``) and divided by the data-parallel size (docs/experts.md)."""
    dp = mesh["dp"]
    dense = [p for p in parameters if id(p) not in expert_ids and p.requires_grad]
    experts = [p for p in parameters if id(p) in expert_ids and p.requires_grad]
    groups = [GradientGroup(dense, dp.get_group(), dp.size(), label="data-parallel mean")]
    if experts:
        replicas = mesh["dp_replicate"]
        groups.append(
            GradientGroup(experts, replicas.get_group(), dp.size(), label="experts over their replicas")
        )
    return groups


def _compressed(groups: list[GradientGroup], compressor: BucketCompressor | None) -> list[GradientGroup]:
    """Compress the plain means over more than one rank (not sums of tied weights, nor expert reductions)."""
    if compressor is None:
        return groups
    return [dataclasses.replace(g, compressor=compressor) if g.is_mean else g for g in groups]


def _tied_weights_uncompressed(
    groups: list[GradientGroup | GradientScale], tied: set[int]
) -> list[GradientGroup | GradientScale]:
    """Average weights tied across pipeline stages (a GPT's embedding and head) without PowerSGD.

    Each stage's data-parallel group compresses its own buckets, with its own error feedback and
    random factors: a lossy approximation of the same gradient would differ on the two stages and
    the two copies of the weight would drift apart (measured: 2.8% after 5 steps at pp=2 x dp=2).
    Casts (bf16/fp16) round identical sums identically, so only PowerSGD needs this.
    """
    if not tied:
        return groups
    out: list[GradientGroup | GradientScale] = []
    for group in groups:
        if (
            not isinstance(group, GradientGroup)
            or group.compressor is None
            or not any(id(p) in tied for p in group.parameters)
        ):
            out.append(group)
            continue
        out.append(dataclasses.replace(group, parameters=[p for p in group.parameters if id(p) not in tied]))
        out.append(
            dataclasses.replace(
                group,
                parameters=[p for p in group.parameters if id(p) in tied],
                compressor=None,
                label="tied weights, uncompressed",
            )
        )
    return out


def _under_zero(
    module: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    runner: PipelineRunner | None,
    expert_ids: set[int],
) -> GradientReductions:
    """ZeRO reduces over the (expert-)data-parallel ranks in its step; before it, only what it cannot do.

    Plain parameters for DeepSpeed first (it flattens them: tensor-parallel weights become their
    local shards, ``zero/tensor_parallel.py``), expert slices flagged as model-parallel. Under
    expert parallelism ZeRO shards over ``dp_replicate``, so the dense gradients are first averaged
    over ``ep`` and the expert gradients divided by ``ep``: ZeRO's mean over ``dp_replicate`` then
    makes dense weights averaged over the whole ``dp`` and experts summed over their replicas
    divided by ``dp``, as without ZeRO.
    """
    if dims.tp_enabled:
        local_shard_parameters(module)
    parameters = list(runner.parameters) if runner is not None else list(module.parameters())
    mark_model_parallel(p for p in parameters if id(p) in expert_ids)
    groups: list[GradientGroup | GradientScale] = (
        list(runner.tied_gradient_groups()) if runner is not None else []
    )
    if dims.ep_enabled:
        trainable = [p for p in parameters if p.requires_grad]
        ep = dims.expert_parallel
        dense = [p for p in trainable if id(p) not in expert_ids]
        groups.append(GradientGroup(dense, mesh["ep"].get_group(), ep, label="dense mean over ep"))
        groups.append(GradientScale([p for p in trainable if id(p) in expert_ids], ep, label="experts"))
    zero_ranks = "dp_replicate" if dims.ep_enabled else "dp"
    return GradientReductions(
        after_backward=GradientSync(groups) if groups else None,
        in_optimizer_step=f"ZeRO's reduction over {zero_ranks} ({mesh[zero_ranks].size()} ranks)",
    )
