"""Structured pruning of MLP channels, by one global threshold over the channels of all ranks.

A channel ``j`` of an MLP ``down(act(up(x)))`` is row ``j`` of ``up`` (and its bias) and column
``j`` of ``down``: setting all of them to zero removes the channel, and a model exported with
those zeros can be physically shrunk. Its score is the squared norm of both,
``|up[j, :]|^2 + |down[:, j]|^2``. Under Megatron's tensor-parallel split ``up`` is cut by rows and
``down`` by columns, so each rank holds whole channels (the same ones of both weights) and scores
them alone; the global threshold over all channels of all MLPs of all stages and ranks is found as
the unstructured one is (:mod:`.threshold`). A channel scored on one tensor-parallel rank is
pruned there; the split respects it because masks never cross a rank.

ZeRO shards the rows of both weights over the data-parallel ranks (FSDP2), which cuts ``down``'s
columns into pieces: it is refused for channel pruning.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_parallel.comm.agreement import all_agree
from lightning_parallel.compression.pruning import MagnitudePruning
from lightning_parallel.compression.threshold import kth_smallest_magnitude
from lightning_parallel.precision.layout_sum import LayoutSum, local_values

__all__ = ["ChannelPruning", "mlp_pairs"]


def mlp_pairs(module: nn.Module, patterns: Sequence[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """``(up, down)`` names: given as ``fnmatch`` pattern pairs, or every module's two ``nn.Linear`` children
    that expand and project back (``up: C -> H``, ``down: H -> C``, ``H > C``), in module order."""
    linears = {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    if patterns is not None:
        return [
            (up, down)
            for up_pattern, down_pattern in patterns
            for up in linears
            if fnmatch.fnmatch(up, up_pattern)
            for down in linears
            if fnmatch.fnmatch(down, down_pattern) and down.rsplit(".", 1)[0] == up.rsplit(".", 1)[0]
        ]
    pairs = []
    for name, parent in module.named_modules():
        children = [
            (f"{name}.{n}" if name else n, m) for n, m in parent.named_children() if isinstance(m, nn.Linear)
        ]
        for (up, a), (down, b) in zip(children, children[1:], strict=False):
            if a.out_features == b.in_features > a.in_features == b.out_features:
                pairs.append((up, down))
    return pairs


class ChannelPruning(MagnitudePruning):
    """Prune whole MLP channels (``amount`` of all channels), on the schedule of :class:`MagnitudePruning`.

    Args:
        amount, start_step, every_n_steps, end_step, ramp: as :class:`MagnitudePruning`.
        pairs: ``(up, down)`` ``fnmatch`` name patterns of the MLPs' projections (a gated MLP names its
            ``up`` projection; its gate's output is multiplied by the pruned zeros); default: found by shape.
    """

    def __init__(
        self, amount: float = 0.5, *, pairs: Sequence[tuple[str, str]] | None = None, **schedule: Any
    ) -> None:
        super().__init__(amount, **schedule)
        self.pairs = list(pairs) if pairs is not None else None
        self._channels: LayoutSum | None = None
        self._ups: list[nn.Linear] = []
        self._downs: list[nn.Linear] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(channels=self.pairs)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        zero = getattr(getattr(getattr(trainer.strategy, "config", None), "zero", None), "enabled", False)
        if zero:
            raise ValueError(
                "ChannelPruning does not run under `zero_stage`: ZeRO shards the rows of both projections over the"
                " data-parallel ranks, which cuts a channel's column of the down projection apart. Use"
                " MagnitudePruning, or zero_stage=0."
            )
        super().on_train_start(trainer, pl_module)

    def _count_selected(self, plugin: Any) -> int:
        """Channels, over the whole model: one per row of each up projection (its layout counts them once)."""
        ups = [up.weight for up in self._ups]
        self._channels = LayoutSum(
            ups,
            getattr(plugin, "pipeline_group", None),
            getattr(plugin, "expert_group", None),
            getattr(plugin, "expert_ids", None),
        )
        return round(
            float(self._channels([torch.ones(local_values(w).shape[0], device=w.device) for w in ups])[0])
        )

    def _select(self, module: nn.Module) -> None:
        names = mlp_pairs(module, self.pairs)
        self._ups = [module.get_submodule(up) for up, _ in names]
        self._downs = [module.get_submodule(down) for _, down in names]
        self._names, self._params = [], []
        for (up, down), a, b in zip(names, self._ups, self._downs, strict=True):
            for name, param in (
                (f"{up}.weight", a.weight),
                (f"{up}.bias", a.bias),
                (f"{down}.weight", b.weight),
            ):
                if param is not None:
                    self._names.append(name)
                    self._params.append(param)

    def _check_pattern(self) -> None:
        bad = [
            f"{type(a).__name__} rows {local_values(a.weight).shape[0]} vs columns {local_values(b.weight).shape[1]}"
            for a, b in zip(self._ups, self._downs, strict=True)
            if local_values(a.weight).shape[0] != local_values(b.weight).shape[1]
        ]
        if not all_agree(not bad):
            where = bad or "on another rank"
            raise ValueError(
                f"ChannelPruning: a rank holds other channels of an up projection than of its down projection ({where});"
                " the tensor-parallel plan must cut `up` by rows and `down` by columns."
            )

    def _prune(self, sparsity: float) -> None:
        assert self._channels is not None
        scores = [
            local_values(a.weight).detach().float().pow(2).sum(1)
            + local_values(b.weight).detach().float().pow(2).sum(0)
            for a, b in zip(self._ups, self._downs, strict=True)
        ]
        k = round(sparsity * self.selected)
        self.threshold = kth_smallest_magnitude(scores, self._channels, k) if k > 0 else -1.0
        keep = [score > self.threshold for score in scores]
        masks: list[Tensor | None] = []
        for a, kept in zip(self._ups, keep, strict=True):
            masks.append(kept[:, None].expand_as(local_values(a.weight)))
            if a.bias is not None:
                masks.append(kept)
            masks.append(kept[None, :])
        self._masks = masks
        self.sparsity = sparsity
        self.pruned = self.selected - round(float(self._channels(keep)[0]))
