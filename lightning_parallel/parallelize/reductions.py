"""Every gradient reduction of a layout, decided in one function from the configuration.

:func:`decide_gradient_reductions` says, from the configuration and the degrees alone (no
process group, no model), which gradients are averaged or summed over which mesh axis, scaled by
what, compressed or not, and when (``parallelize/gradients.py`` installs them). The moments:

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
  explicit part that must come first (tied weights, the dense gradients' mean over ``ep``);
- after the optimizer step: ZeRO-2 on FSDP2 gathers its updated shards.

``python -c`` answer to "which reductions run under pp=2 x ep=2 with ZeRO-1?"::

    print("\\n".join(map(str, decide_gradient_reductions(config, dims))))
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lightning_parallel.comm.compression import GradientCompression, PowerSGD
from lightning_parallel.config import ParallelConfig
from lightning_parallel.mesh import Axis, ParallelDims
from lightning_parallel.zero.engine_choice import Engine, config_engine

__all__ = ["Gradients", "How", "Moment", "Reduction", "decide_gradient_reductions"]


class Moment(StrEnum):
    """When a reduction runs, in the order of a step."""

    IN_BACKWARD = "inside backward"
    IN_LAST_BACKWARD = (
        "during the last backward"  # bucket by bucket, as the step's last backward finishes them
    )
    AFTER_BACKWARD = "after backward"
    IN_STEP = "in the optimizer step"
    AFTER_STEP = "after the optimizer step"


class Gradients(StrEnum):
    """Which gradients a reduction takes."""

    ALL = "all"
    DENSE = "dense"  # not experts
    EXPERTS = "experts"
    TIED = "tied"  # weights held by several pipeline stages
    DENSE_BUT_TIED = "dense but tied"
    STRIDED_VECTORS = "strided vector"  # the fused biases FSDP2 keeps whole
    PARAMETERS = "all parameters'"  # not gradients: ZeRO-2's gather of the updated shards
    SHARED_ROWS = "k/v rows held on several ranks'"  # found on the model (tensor_parallel/row_layout.py)


class How(StrEnum):
    """What a reduction computes over its axis."""

    MEAN = "mean"
    SUM = "sum"
    SUM_OVER_DP = "sum / dp size"
    DIVIDED_BY_EP = "divided by ep"  # no communication: the other ranks' share comes later
    ALL_GATHER = "all-gather"
    SUM_OF_COPIES = "sum of the copies"


@dataclass(frozen=True)
class Reduction:
    """One reduction of a layout: which gradients, how, over which mesh axis, when; printed as a sentence."""

    gradients: Gradients
    how: How
    axis: Axis | None  # None: no communication (a scaling); PP for a tied weight: the stages holding it
    when: Moment
    compression: GradientCompression | None = None
    detail: str = ""  # how it runs, printed after ``how`` ("(ZeRO's)", "(reduce-scatter of ...)")

    def __str__(self) -> str:
        how = f"{self.how} {self.detail}" if self.detail else str(self.how)
        over = f" over {self.axis}" if self.axis is not None else ""
        compressed = f", compressed ({self.compression!r})" if self.compression is not None else ""
        return f"{self.when}: {self.gradients} gradients, {how}{over}{compressed}"


MOMENTS = tuple(Moment)


def decide_gradient_reductions(config: ParallelConfig, dims: ParallelDims) -> list[Reduction]:
    """The reductions of a layout, in the order they run (identical on every rank; stable within a moment)."""
    return reductions_for(config, dims, config_engine(config, dims))


def reductions_for(config: ParallelConfig, dims: ParallelDims, engine: Engine | None) -> list[Reduction]:
    """:func:`decide_gradient_reductions` with ZeRO's engine as the recipe resolved it (``zero/engine_choice.py``)."""
    return sorted(_decide(config, dims, engine), key=lambda r: MOMENTS.index(r.when))


def _decide(config: ParallelConfig, dims: ParallelDims, engine: Engine | None) -> list[Reduction]:
    if engine == "fsdp2":
        return _fsdp_reductions(config, dims)
    out = [Reduction(Gradients.TIED, How.SUM, Axis.PP, Moment.AFTER_BACKWARD)] if dims.pp_enabled else []
    if config.zero.enabled:
        if dims.ep_enabled:
            # ZeRO shards over dp_replicate: its mean there then makes dense weights averaged over the
            # whole dp and experts summed over their replicas divided by dp, as without ZeRO.
            out += [
                Reduction(Gradients.DENSE, How.MEAN, Axis.EP, Moment.IN_LAST_BACKWARD),
                Reduction(Gradients.EXPERTS, How.DIVIDED_BY_EP, None, Moment.AFTER_BACKWARD),
            ]
        axis = Axis.DP_REPLICATE if dims.ep_enabled else Axis.DP
        return [*out, Reduction(Gradients.ALL, How.MEAN, axis, Moment.IN_STEP, detail="(ZeRO's)")]
    compression = config.memory.gradient_compression if dims.dp_enabled else None
    if not (dims.pp_enabled or dims.ep_enabled):
        if not dims.dp_enabled:
            return []
        return [Reduction(Gradients.ALL, How.MEAN, Axis.DP, Moment.IN_BACKWARD, compression)]
    if not dims.dp_enabled:
        pass  # one data-parallel replica: its mean is the gradient itself (no buckets, no copies, no hooks)
    elif dims.pp_enabled and isinstance(compression, PowerSGD):
        # Each stage's group would compress a tied weight with its own error feedback and random
        # factors, and its copies would drift apart (measured: 2.8% after 5 steps at pp=2 x dp=2);
        # casts round identical sums identically, so only PowerSGD leaves them out.
        out += [
            Reduction(Gradients.DENSE_BUT_TIED, How.MEAN, Axis.DP, Moment.AFTER_BACKWARD, compression),
            Reduction(Gradients.TIED, How.MEAN, Axis.DP, Moment.IN_LAST_BACKWARD),
        ]
    else:  # a compressor keeps state per bucket and step: compressed means run after backward
        when = Moment.AFTER_BACKWARD if compression else Moment.IN_LAST_BACKWARD
        out.append(Reduction(Gradients.DENSE, How.MEAN, Axis.DP, when, compression))
    if dims.ep_enabled:
        # An expert's gradient already holds its ep group's tokens (docs/experts.md).
        out.append(Reduction(Gradients.EXPERTS, How.SUM_OVER_DP, Axis.DP_REPLICATE, Moment.IN_LAST_BACKWARD))
    return out


def _fsdp_reductions(config: ParallelConfig, dims: ParallelDims) -> list[Reduction]:
    """ZeRO on FSDP2 (zero/fsdp.py): reduce-scatters inside backward; under pipeline stages once per batch,
    during each stage's last backward. Experts (their own units over their replicas) are summed and divided by dp."""
    when, after = (
        (Moment.IN_LAST_BACKWARD, ", once per batch") if dims.pp_enabled else (Moment.IN_BACKWARD, "")
    )
    shards = f"(reduce-scatter of ZeRO-{config.zero.stage}'s shards){after}"
    dense = Gradients.DENSE if dims.ep_enabled else Gradients.ALL
    steps = [Reduction(dense, How.MEAN, Axis.DP, when, detail=shards)]
    if dims.ep_enabled:
        steps.append(Reduction(Gradients.EXPERTS, How.SUM_OVER_DP, Axis.DP_REPLICATE, when, detail=shards))
    if dims.pp_enabled:
        steps.append(Reduction(Gradients.TIED, How.SUM, Axis.PP, Moment.AFTER_BACKWARD))
    steps.append(Reduction(Gradients.STRIDED_VECTORS, How.MEAN, Axis.DP, Moment.IN_LAST_BACKWARD))
    if config.zero.stage == 2:  # ZeRO-2 keeps whole parameters between steps: gather the updated shards
        steps.append(Reduction(Gradients.PARAMETERS, How.ALL_GATHER, Axis.DP, Moment.AFTER_STEP))
    return steps
