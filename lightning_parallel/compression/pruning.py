"""Magnitude pruning of a sharded model, as a Lightning callback: global threshold, 2:4, gradual.

Lightning's ``ModelPruning`` uses ``torch.nn.utils.prune``, which computes each mask on the
tensor it is given: under tensor parallelism or FSDP2 that is the rank's shard, so the global
threshold becomes a per-shard one, and its re-parametrisation (``weight_orig`` and
``weight_mask`` tensors) breaks sharded checkpoints and DTensor parameters. Here:

- the masks are local-shard boolean tensors beside the parameters, never module state: the
  pruned weights are exactly zero, so a checkpoint, a resharded resume and ``export`` carry the
  pruning in the weights themselves (a resume rebuilds the masks from the zeros);
- the masks are re-applied right after every optimizer step (a post-step hook of the optimizer,
  inside the strategy's step: before FSDP2 gathers the updated shards again), so momentum and
  weight decay never revive a pruned weight;
- unstructured pruning takes one threshold over all weights of all ranks
  (:mod:`.threshold`: the same masks as one process computes on the same weights);
- ``"2:4"`` keeps the two largest of every four consecutive weights along the input dimension
  (NVIDIA's semi-structured sparsity), computed on each shard: a rank must hold whole groups.

DeepSpeed's engine (ZeRO-1/2, offload at stage 1-3 without model parallelism) keeps fp32 master
weights the callback cannot see, which would revive the pruned weights at the next step; it is
refused at setup (FSDP2's ZeRO, chosen with tensor or pipeline parallelism, works).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_parallel.comm.agreement import all_agree
from lightning_parallel.compression.schedule import PruningSchedule
from lightning_parallel.compression.selection import body_linears
from lightning_parallel.compression.threshold import kth_smallest_magnitude
from lightning_parallel.precision.layout_sum import LayoutSum, local_values

__all__ = ["MagnitudePruning"]

PATTERNS = ("unstructured", "2:4")


def two_four_mask(local: Tensor) -> Tensor:
    """True for the two largest magnitudes of every four consecutive elements of the last dimension."""
    groups = local.detach().abs().reshape(-1, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.topk(2, dim=1).indices, True)
    return keep.view(local.shape)


class MagnitudePruning(Callback):
    """Prune weights by magnitude while training, under any layout of ``HybridParallelStrategy``.

    Args:
        amount: the final fraction of the selected weights set to zero, in [0, 1); ``"2:4"`` needs 0.5.
        pattern: ``"unstructured"`` (one global threshold over all selected weights) or ``"2:4"``.
        parameters: ``fnmatch`` patterns of parameter names to prune (the user's names); default:
            every ``nn.Linear`` weight but the output head (``compression/selection.py``).
        start_step, every_n_steps, end_step, ramp: the gradual schedule (:class:`PruningSchedule`);
            by default one event before the first optimizer step.
    """

    def __init__(
        self,
        amount: float = 0.5,
        *,
        pattern: str = "unstructured",
        parameters: Sequence[str] | None = None,
        start_step: int = 0,
        every_n_steps: int = 1,
        end_step: int | None = None,
        ramp: str = "cubic",
    ) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"`pattern={pattern!r}` is not one of {PATTERNS}.")
        if pattern == "2:4" and amount != 0.5:
            raise ValueError(
                f"`pattern='2:4'` prunes exactly half of the weights: set `amount=0.5`, not {amount!r}."
            )
        self.schedule = PruningSchedule(amount, start_step, every_n_steps, end_step, ramp)
        self.pattern = pattern
        self.parameters = list(parameters) if parameters is not None else None
        self.steps_done = 0
        self.last_event_step = -1  # steps done when the last event ran (a resume must not repeat it)
        self.sparsity = 0.0  # of the last event
        self.threshold: float | None = None  # of the last unstructured event
        self.pruned = 0  # weights set to zero at the last event, over the whole model
        self.selected = 0  # weights selected, over the whole model
        self._names: list[str] = []
        self._params: list[Tensor] = []
        self._masks: list[Tensor | None] = []
        self._count: LayoutSum | None = None
        self._hooks: list[Any] = []

    # ---- Lightning hooks -------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "deepspeed_zero", False):
            raise ValueError(
                "MagnitudePruning cannot run on DeepSpeed's engine (this layout's `zero_stage`/`offload`): its fp32"
                " master weights would revive the pruned weights at every step. Use zero_stage=0, or ZeRO with"
                " tensor or pipeline parallelism (FSDP2)."
            )
        self._select(pl_module)
        plugin = strategy.precision_plugin
        self._count = LayoutSum(
            self._params,
            pipeline_group=getattr(plugin, "pipeline_group", None),
            expert_group=getattr(plugin, "expert_group", None),
            expert_ids=getattr(plugin, "expert_ids", None),
            exclude=getattr(plugin, "norm_exclude", None),
        )
        self.selected = self._count_selected(plugin)
        if self.selected == 0:
            raise ValueError(
                f"MagnitudePruning: `parameters={self.parameters!r}` selects no weight of"
                f" {type(pl_module).__name__}; name them with fnmatch patterns of `named_parameters()`."
            )
        self._check_pattern()
        # A resume: the pruned weights are the zeros of the restored weights.
        self._masks = [local_values(p) != 0 if self.sparsity > 0 else None for p in self._params]
        self._remove_hooks()
        self._hooks = [opt.register_step_post_hook(self._after_step) for opt in trainer.optimizers[:1]]
        self._event()  # an event before the first step (start_step=0), not again on a resume

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._remove_hooks()  # a later fit registers its own: two would count every step twice

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(pattern=self.pattern, parameters=self.parameters)

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "last_event_step": self.last_event_step,
            "sparsity": self.sparsity,
            "threshold": self.threshold,
            "pruned": self.pruned,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps_done = int(state_dict["steps_done"])
        self.last_event_step = int(state_dict["last_event_step"])
        self.sparsity = float(state_dict["sparsity"])
        self.threshold = state_dict["threshold"]
        self.pruned = int(state_dict["pruned"])

    # ---- the work --------------------------------------------------------------------------

    def _select(self, module: nn.Module) -> None:
        wanted = [f"{name}.weight" for name in body_linears(module)] if self.parameters is None else None
        self._names, self._params = [], []
        for name, param in module.named_parameters():
            chosen = (
                name in wanted
                if wanted is not None
                else any(fnmatch.fnmatch(name, p) for p in self.parameters)
            )
            if chosen and param.dim() >= 2:
                self._names.append(name)
                self._params.append(param)

    def _count_selected(self, plugin: Any) -> int:
        """How many units the amount is a fraction of, over the whole model: here weights."""
        assert self._count is not None
        return round(
            float(self._count([torch.ones_like(local_values(p), dtype=torch.bool) for p in self._params])[0])
        )

    def _check_pattern(self) -> None:
        bad = [
            f"{name} (local shape {tuple(local_values(p).shape)})"
            for name, p in zip(self._names, self._params, strict=True)
            if self.pattern == "2:4" and local_values(p).shape[-1] % 4
        ]
        if not all_agree(not bad):
            raise ValueError(
                "`pattern='2:4'` needs each rank's shard of a weight to hold whole groups of 4 along the last"
                f" dimension; not so for {bad or 'a weight on another rank'}. Exclude it with `parameters=`, or use"
                " another tensor-parallel degree."
            )

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps_done += 1
        self._event()

    @torch.no_grad()
    def _event(self) -> None:
        """Prune if the schedule says so after this many steps, and keep the pruned weights at zero."""
        sparsity = self.schedule.sparsity_at(self.steps_done)
        if sparsity is not None and self.last_event_step != self.steps_done:
            self._prune(sparsity)
            self.last_event_step = self.steps_done
        for param, mask in zip(self._params, self._masks, strict=True):
            if mask is not None:
                local_values(param).mul_(mask)

    def _prune(self, sparsity: float) -> None:
        assert self._count is not None
        if self.pattern == "2:4":
            self._masks = [two_four_mask(local_values(p)) for p in self._params]
            sparsity = 0.5  # whatever the schedule's ramp says: 2:4 is half of every group
        else:
            magnitudes = [local_values(p).detach().abs().float() for p in self._params]
            k = round(sparsity * self.selected)
            self.threshold = kth_smallest_magnitude(magnitudes, self._count, k) if k > 0 else -1.0
            self._masks = [m > self.threshold for m in magnitudes]
        self.sparsity = sparsity
        self.pruned = self.selected - round(float(self._count(self._masks)[0]))
