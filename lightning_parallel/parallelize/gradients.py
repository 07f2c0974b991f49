"""Every gradient reduction of a layout, decided in one function from the configuration.

:func:`decide_gradient_reductions` says, from the configuration and the degrees alone (no
process group, no model), which gradients are averaged or summed over which mesh axis, scaled by
what, compressed or not, and when; :func:`plan_gradient_reductions` installs exactly those on
this rank's module, and nothing edits them afterwards. Three moments exist:

- inside backward: DDP's reducer or FSDP2's ``replicate`` over ``dp`` (data parallelism, with or
  without tensor parallelism), paused while gradients accumulate;
- during the last backward of an optimizer step (under pipeline stages: each stage's last
  micro-batch backward): explicit bucketed all-reduces (``data_parallel/gradient_sync.py``) where
  DDP-style hooks cannot express the reduction: pipeline schedules (backward per micro-batch),
  sharded experts (expert weights over their replicas only); each bucket is launched as soon as
  its gradients are final, overlapping the backward still to run;
- after the last backward: what needs the whole gradient first (tied weights summed across
  stages, compressed means, scalings);
- in the optimizer step: DeepSpeed's ZeRO engine over the (expert-)data-parallel ranks, after the
  explicit part that must come first (tied weights, the dense gradients' mean over ``ep``).

``python -c`` answer to "which reductions run under pp=2 x ep=2 with ZeRO-1?"::

    print("\\n".join(map(str, decide_gradient_reductions(config, dims))))
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.comm.compression import (
    BucketCompressor,
    GradientCompression,
    PowerSGD,
    register_ddp_compression,
)
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
from lightning_parallel.pipeline.runner import PipelineRunner
from lightning_parallel.tensor_parallel.row_layout import RowCopies, stamp_row_layouts
from lightning_parallel.zero.engine import config_engine
from lightning_parallel.zero.fsdp import ExpertSharding, Sharded, fully_shard_modules, regather
from lightning_parallel.zero.tensor_parallel import (
    local_shard_parameters,
    mark_model_parallel,
    registered_parameter,
)

IN_BACKWARD, AFTER_BACKWARD, IN_STEP = "inside backward", "after backward", "in the optimizer step"
IN_LAST_BACKWARD = "during the last backward"  # bucket by bucket, as the step's last backward finishes them
AFTER_STEP = "after the optimizer step"


@dataclass(frozen=True)
class Reduction:
    """One reduction of a layout, by name: which gradients, how, over which mesh axis, when."""

    gradients: str  # "all", "dense" (not experts), "experts", "tied" (weights held by several stages), "dense but tied"
    how: str  # "mean", "sum", "sum / dp size", "divided by ep"
    axis: str  # a mesh axis; "pp" for a tied weight: the stages holding it
    when: str  # IN_BACKWARD, IN_LAST_BACKWARD, AFTER_BACKWARD, IN_STEP or AFTER_STEP
    compression: GradientCompression | None = None

    def __str__(self) -> str:
        over = f" over {self.axis}" if self.how != "divided by ep" else ""
        compressed = f", compressed ({self.compression!r})" if self.compression is not None else ""
        return f"{self.when}: {self.gradients} gradients, {self.how}{over}{compressed}"


MOMENTS = (IN_BACKWARD, IN_LAST_BACKWARD, AFTER_BACKWARD, IN_STEP, AFTER_STEP)


def decide_gradient_reductions(config: ParallelConfig, dims: ParallelDims) -> list[Reduction]:
    """The reductions of a layout, in the order they run (identical on every rank; stable within a moment)."""
    return sorted(_decide(config, dims), key=lambda r: MOMENTS.index(r.when))


def _decide(config: ParallelConfig, dims: ParallelDims) -> list[Reduction]:
    engine = config_engine(config, dims)
    if engine == "fsdp2":
        return _fsdp_reductions(config, dims)
    out = [Reduction("tied", "sum", "pp", AFTER_BACKWARD)] if dims.pp_enabled else []
    if config.zero.enabled:
        if dims.ep_enabled:
            # ZeRO shards over dp_replicate: its mean there then makes dense weights averaged over the
            # whole dp and experts summed over their replicas divided by dp, as without ZeRO.
            out += [
                Reduction("dense", "mean", "ep", IN_LAST_BACKWARD),
                Reduction("experts", "divided by ep", "", AFTER_BACKWARD),
            ]
        return [*out, Reduction("all", "mean (ZeRO's)", "dp_replicate" if dims.ep_enabled else "dp", IN_STEP)]
    compression = config.memory.gradient_compression if dims.dp_enabled else None
    if not (dims.pp_enabled or dims.ep_enabled):
        return [Reduction("all", "mean", "dp", IN_BACKWARD, compression)] if dims.dp_enabled else []
    if not dims.dp_enabled:
        pass  # one data-parallel replica: its mean is the gradient itself (no buckets, no copies, no hooks)
    elif dims.pp_enabled and isinstance(compression, PowerSGD):
        # Each stage's group would compress a tied weight with its own error feedback and random
        # factors, and its copies would drift apart (measured: 2.8% after 5 steps at pp=2 x dp=2);
        # casts round identical sums identically, so only PowerSGD leaves them out.
        out += [
            Reduction("dense but tied", "mean", "dp", AFTER_BACKWARD, compression),
            Reduction("tied", "mean", "dp", IN_LAST_BACKWARD),
        ]
    else:  # a compressor keeps state per bucket and step: compressed means run after backward
        out.append(
            Reduction("dense", "mean", "dp", AFTER_BACKWARD if compression else IN_LAST_BACKWARD, compression)
        )
    if dims.ep_enabled:
        # An expert's gradient already holds its ep group's tokens (docs/experts.md).
        out.append(Reduction("experts", "sum / dp size", "dp_replicate", IN_LAST_BACKWARD))
    return out


def _fsdp_reductions(config: ParallelConfig, dims: ParallelDims) -> list[Reduction]:
    """ZeRO on FSDP2 (zero/fsdp.py): reduce-scatters inside backward; under pipeline stages once per batch,
    during each stage's last backward. Experts (their own units over their replicas) are summed and divided by dp."""
    when, after = (IN_LAST_BACKWARD, ", once per batch") if dims.pp_enabled else (IN_BACKWARD, "")
    shards = f"(reduce-scatter of ZeRO-{config.zero.stage}'s shards){after}"
    steps = [Reduction("dense" if dims.ep_enabled else "all", f"mean {shards}", "dp", when)]
    if dims.ep_enabled:
        steps.append(Reduction("experts", f"sum / dp size {shards}", "dp_replicate", when))
    if dims.pp_enabled:
        steps.append(Reduction("tied", "sum", "pp", AFTER_BACKWARD))
    steps.append(
        Reduction("strided vector", "mean", "dp", IN_LAST_BACKWARD)
    )  # fused biases FSDP2 keeps whole
    if config.zero.stage == 2:  # ZeRO-2 keeps whole parameters between steps: gather the updated shards
        steps.append(Reduction("all parameters'", "all-gather", "dp", AFTER_STEP))
    return steps


@dataclass
class GradientReductions:
    """The reductions of one layout, installed on this rank's module, as the strategy's hooks run them."""

    decided: list[Reduction] = field(default_factory=list)
    """What :func:`decide_gradient_reductions` decided (``describe`` prints it)."""
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
        return [str(r) for r in self.decided] or ["none (one data-parallel replica)"]


def plan_gradient_reductions(
    module: nn.Module,
    config: ParallelConfig,
    dims: ParallelDims,
    mesh: DeviceMesh,
    *,
    runner: PipelineRunner | None,
    expert_ids: set[int],
    blocks: list[str],
    fsdp: Sharded | None = None,
) -> GradientReductions:
    """Install the decided reductions on this rank's part of the model (the recipe's last step).

    ``fsdp``: under ZeRO on FSDP2, what :func:`shard_for_zero` made (before the pipeline's stages were
    built on the sharded parameters).
    """
    decided = decide_gradient_reductions(config, dims)
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
        if any(r.when == AFTER_STEP for r in decided):
            result.regather = fsdp.units
        return result
    if config.zero.enabled:  # expert slices differ across ep ranks: DeepSpeed's norm counts them on each
        mark_model_parallel(p for p in _parameters(module, runner) if id(p) in expert_ids)
    if any(r.when == IN_BACKWARD for r in decided):
        dp_mesh = mesh[Axis.DP]
        result.in_backward = apply_data_parallel(module, dp_mesh, blocks, sharded_parameters=dims.tp_enabled)
        result.hooks = average_direct_parameters(module, dp_mesh)
        if (
            decided[0].compression is not None
        ):  # tp without stages or experts was refused (config/validation.py)
            register_ddp_compression(result.in_backward, decided[0].compression, dp_mesh.get_group())
    explicit = [r for r in decided if r.when in (IN_LAST_BACKWARD, AFTER_BACKWARD)]
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
    result.decided.append(
        Reduction("k/v rows held on several ranks'", "sum of the copies", "tp", AFTER_BACKWARD)
    )
    return [RowCopies(duplicated, mesh[Axis.TP].get_group())]


def _sync(groups: list[Any], runner: PipelineRunner | None) -> GradientSync | None:
    """The explicit reductions; under pipeline stages the runner opens each stage's last backward to them."""
    if not groups:
        return None
    sync = GradientSync(groups, runner.last_backward.final_calls() if runner is not None else {})
    if runner is not None:
        runner.last_backward.sync = sync
    return sync


def shard_for_zero(
    module: nn.Module, config: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh, blocks: list[str]
) -> Sharded | None:
    """The parameters ZeRO's engine takes, before the pipeline's stages exist (they capture the parameters).

    FSDP2 (``zero/engine.py: engine_for``): ``fully_shard`` the blocks this rank holds and the rest.
    DeepSpeed with tensor parallelism: each DTensor weight re-registered as its plain local shard
    (returns None, as without ZeRO).
    """
    engine = config_engine(config, dims)
    if (
        engine == "deepspeed" and dims.tp_enabled
    ):  # DeepSpeed flattens plain tensors (zero/tensor_parallel.py)
        local_shard_parameters(module)
    if engine != "fsdp2":
        return None
    from lightning_parallel.pipeline.stages import SkippedBlock

    kept = [module.get_submodule(b) for b in blocks if not isinstance(module.get_submodule(b), SkippedBlock)]
    # Gathered once per step under stages (not once per micro-batch) unless the user asks for the memory;
    # ZeRO-3 alone reshards after forward.
    reshard = config.zero.stage == 3 and (not dims.pp_enabled or config.zero.reshard == "micro_batch")
    # Experts over their replicas (dp_replicate), everything else over the whole dp (zero/fsdp.py).
    experts = ExpertSharding(mesh[Axis.DP_REPLICATE], dims.data_parallel) if dims.ep_enabled else None
    return fully_shard_modules(
        module, mesh[Axis.DP], kept, offload=config.zero.offload is not None, reshard_after_forward=reshard,
        experts=experts, offload_ratio=config.zero.offload_ratio,
    )  # fmt: skip


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
        overlap = r.when == IN_LAST_BACKWARD
        if (r.gradients, r.axis) == ("tied", "pp"):
            assert runner is not None
            groups += runner.tied_gradient_groups()
        elif r.gradients == "dense" and r.axis == "ep":
            ep = mesh[Axis.EP]
            groups.append(
                GradientGroup(dense, ep.get_group(), ep.size(), label="dense mean over ep", overlap=overlap)
            )
        elif r.gradients == "experts" and r.how == "divided by ep":
            groups.append(GradientScale(experts, mesh[Axis.EP].size(), label="experts"))
        elif r.gradients == "dense" or (r.gradients == "dense but tied" and not tied):
            groups.append(_mean(dense, dp, compressor, "data-parallel mean", overlap))
        elif r.gradients == "dense but tied":
            groups.append(
                _mean([p for p in dense if id(p) not in tied], dp, compressor, "data-parallel mean")
            )
        elif (r.gradients, r.axis) == ("tied", "dp"):
            if tied:  # this rank holds a tied weight: its mean uncompressed (the split above)
                groups.append(
                    _mean(
                        [p for p in dense if id(p) in tied], dp, None, "tied weights, uncompressed", overlap
                    )
                )
        elif r.gradients == "experts" and experts:
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
    overlap: bool = False,
) -> GradientGroup:
    group = GradientGroup(params, dp.get_group(), dp.size(), label=label)
    if compressor is not None and group.is_mean:  # never the sums of tied weights, nor expert reductions
        group.compressor = compressor
    group.overlap = overlap and group.compressor is None
    return group
