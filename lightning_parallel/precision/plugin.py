"""Lightning precision plugins for ``HybridParallelStrategy``.

Lightning's own plugins already do the precision work (autocast contexts, module and input
casts, the loss-scaling step); they only get two things wrong under model parallelism:

- clipping by norm calls ``torch.nn.utils.clip_grad_norm_``, which counts a replicated
  parameter once per rank under TP, ignores the other pipeline stages and fails on
  DTensors from different meshes;
- fp16 loss scaling decides step-or-skip from the rank's own shards only.

So each plugin here is Lightning's plugin with those two pieces replaced: clipping by the
global norm (:mod:`.grad_norm`) and a :class:`~.loss_scaler.DistributedGradScaler`.

The Trainer builds its plugin from ``Trainer(precision=...)`` before the strategy exists as
a process group; the strategy swaps it with :func:`convert_precision_plugin`, once early
(to refuse an unsupported precision before launching) and once after the mesh is built (to
attach the pipeline group).
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Steppable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.precision._partial import reduce_partial_grads_
from lightning_parallel.precision.grad_norm import clip_grad_norm_, clip_grad_value_
from lightning_parallel.precision.grouped_mm_autocast import register_grouped_mm_autocast
from lightning_parallel.precision.loss_scaler import DistributedGradScaler

__all__ = [
    "SUPPORTED_PRECISIONS",
    "HybridHalfPrecision",
    "HybridMixedPrecision",
    "HybridPrecision",
    "build_precision_plugin",
    "convert_precision_plugin",
]

SUPPORTED_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
"""The ``Trainer(precision=...)`` values ``HybridParallelStrategy`` supports."""


class HybridPrecision(Precision):
    """Full precision (``"32-true"``), with gradient clipping over the whole sharded model.

    Also the base of the other plugins here: ``isinstance(plugin, HybridPrecision)`` means
    "already mesh-aware".

    Args:
        pipeline_group: the pipeline-stage group (``mesh[Axis.PP].get_group()``) over which
            gradient norms are summed; ``None`` without pipeline parallelism.
    """

    def __init__(self, *, pipeline_group: ProcessGroup | None = None) -> None:
        self.pipeline_group = pipeline_group
        # Weights held by two pipeline stages (a tied embedding and head) count once in the norm.
        self.norm_exclude: set[int] = set()
        # Expert parallelism: this rank's expert parameters, whose norms are summed over the ep group too.
        self.expert_group: ProcessGroup | None = None
        self.expert_ids: set[int] = set()

    def set_norm_layout(
        self, norm_exclude: set[int], expert_ids: set[int], expert_group: ProcessGroup | None
    ) -> None:
        """What the gradient norm must know of the layout: tied weights another stage counts, this rank's experts."""
        self.norm_exclude, self.expert_ids, self.expert_group = norm_exclude, expert_ids, expert_group

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Steppable) -> None:
        """Reduce ``Partial`` gradients (sequence-parallel norms) in one bucketed all-reduce per group.

        Left alone, the optimizer would reduce each such gradient separately inside its step
        (one collective per norm weight); here it is done once, before the user's
        ``on_before_optimizer_step`` hooks and clipping, which then see the true gradients.
        """
        reduce_partial_grads_(list(self.main_params(optimizer)))
        super()._after_closure(model, optimizer)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of the full model: shards summed, replicas counted once, stages summed."""
        clip_grad_norm_(
            list(self.main_params(optimizer)),
            clip_val,
            pipeline_group=self.pipeline_group,
            norm_exclude=self.norm_exclude,
            expert_group=self.expert_group,
            expert_ids=self.expert_ids,
        )

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clamp on local shards, after reducing ``Partial`` gradients (clamping addends is wrong)."""
        clip_grad_value_(list(self.main_params(optimizer)), clip_val)


class HybridMixedPrecision(HybridPrecision, MixedPrecision):
    """Autocast mixed precision (``"bf16-mixed"`` or ``"16-mixed"``), from Lightning's ``MixedPrecision``.

    Grouped matmuls (the experts of Hugging Face's MoE models) get autocast's matmul rule, which torch
    lacks (:mod:`.grouped_mm_autocast`).

    For ``"16-mixed"`` the loss scaler is a :class:`DistributedGradScaler`: every rank skips
    the step when any rank's gradients overflowed, and all scales move together. A plain
    ``torch.amp.GradScaler`` passed as ``scaler`` is converted, keeping its settings.

    Args:
        precision: ``"bf16-mixed"`` or ``"16-mixed"``.
        device: device type for ``torch.autocast`` and the scaler (``"cuda"``, ``"cpu"``).
        scaler: optional scaler for ``"16-mixed"``.
        pipeline_group: see :class:`HybridPrecision`.
        found_inf_group: ranks that must agree on overflow; ``None`` (the world) is right
            for every layout of ``HybridParallelStrategy``.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str,
        scaler: torch.amp.GradScaler | None = None,
        *,
        pipeline_group: ProcessGroup | None = None,
        found_inf_group: ProcessGroup | None = None,
    ) -> None:
        if precision == "16-mixed":
            if scaler is None:
                scaler = DistributedGradScaler(device, group=found_inf_group)
            else:
                scaler = DistributedGradScaler.from_scaler(scaler, group=found_inf_group)
        MixedPrecision.__init__(self, precision, device, scaler)
        HybridPrecision.__init__(self, pipeline_group=pipeline_group)
        register_grouped_mm_autocast()  # the experts of Hugging Face's MoE models would stay fp32

    @property
    def found_inf_group(self) -> ProcessGroup | None:
        return self.scaler.group if isinstance(self.scaler, DistributedGradScaler) else None

    @found_inf_group.setter
    def found_inf_group(self, group: ProcessGroup | None) -> None:
        if isinstance(self.scaler, DistributedGradScaler):
            self.scaler.group = group


class HybridHalfPrecision(HybridPrecision, HalfPrecision):
    """Module and inputs in half precision (``"bf16-true"`` or ``"16-true"``), from ``HalfPrecision``.

    ``convert_module`` casts every parameter and buffer (DTensors included) with
    ``module.to(dtype)``; clipping norms are accumulated in float32 whatever the grad dtype.
    ``"16-true"`` has no loss scaling, as in Lightning.
    """

    def __init__(
        self,
        precision: Literal["bf16-true", "16-true"] = "bf16-true",
        *,
        pipeline_group: ProcessGroup | None = None,
    ) -> None:
        HalfPrecision.__init__(self, precision)
        HybridPrecision.__init__(self, pipeline_group=pipeline_group)


def build_precision_plugin(
    precision: str,
    device_type: str = "cpu",
    *,
    pipeline_group: ProcessGroup | None = None,
    found_inf_group: ProcessGroup | None = None,
) -> HybridPrecision:
    """Return the mesh-aware plugin for a ``Trainer(precision=...)`` value.

    Args:
        precision: one of :data:`SUPPORTED_PRECISIONS`.
        device_type: ``"cuda"`` or ``"cpu"``: where autocast and the loss scaler run.
        pipeline_group: see :class:`HybridPrecision`.
        found_inf_group: see :class:`HybridMixedPrecision`.
    """
    if precision == "32-true":
        return HybridPrecision(pipeline_group=pipeline_group)
    if precision in ("bf16-mixed", "16-mixed"):
        return HybridMixedPrecision(
            precision,  # type: ignore[arg-type]
            device_type,
            pipeline_group=pipeline_group,
            found_inf_group=found_inf_group,
        )
    if precision in ("bf16-true", "16-true"):
        return HybridHalfPrecision(precision, pipeline_group=pipeline_group)  # type: ignore[arg-type]
    raise ValueError(
        f"`precision={precision!r}` is not supported by HybridParallelStrategy. Choose one of"
        f" {', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}."
    )


def convert_precision_plugin(
    plugin: Precision,
    *,
    pipeline_group: ProcessGroup | None = None,
    found_inf_group: ProcessGroup | None = None,
) -> HybridPrecision:
    """Swap the plugin Lightning chose from ``Trainer(precision=...)`` for the mesh-aware one.

    Idempotent: a plugin from this module is returned as is, with the groups (re)attached,
    so the strategy may call this early without groups and again once the mesh exists.
    Lightning's ``Precision``, ``MixedPrecision`` (its scaler's settings and state are kept)
    and ``HalfPrecision`` are converted; any other plugin is refused, because silently
    dropping what it does (fp8, quantisation, double precision) would be worse.

    Args:
        plugin: ``trainer.strategy.precision_plugin`` as the accelerator connector set it.
        pipeline_group: see :class:`HybridPrecision`.
        found_inf_group: see :class:`HybridMixedPrecision`.
    """
    if isinstance(plugin, HybridPrecision):
        plugin.pipeline_group = pipeline_group
        if isinstance(plugin, HybridMixedPrecision):
            plugin.found_inf_group = found_inf_group
        return plugin
    if type(plugin) is MixedPrecision:
        return HybridMixedPrecision(
            plugin.precision,  # type: ignore[arg-type]
            plugin.device,
            plugin.scaler,
            pipeline_group=pipeline_group,
            found_inf_group=found_inf_group,
        )
    if type(plugin) is HalfPrecision:
        return HybridHalfPrecision(plugin.precision, pipeline_group=pipeline_group)
    if type(plugin) is Precision and plugin.precision == "32-true":
        return HybridPrecision(pipeline_group=pipeline_group)
    raise ValueError(
        f"The precision plugin {type(plugin).__name__}(precision={plugin.precision!r}) cannot be used with"
        f" HybridParallelStrategy: it does not know that parameters are sharded over a device mesh."
        f" Use `Trainer(precision=...)` with one of {', '.join(repr(p) for p in SUPPORTED_PRECISIONS)},"
        " or pass a plugin from `lightning_parallel.precision.build_precision_plugin`."
    )
