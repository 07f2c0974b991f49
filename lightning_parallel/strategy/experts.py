"""The expert-parallel part of ``HybridParallelStrategy``: shard experts, reduce their gradients, add aux losses.

Experts are sharded over the ``ep`` axis, carved out of the data-parallel ranks
(``dp = dp_replicate x ep``, as in Megatron and DeepSpeed-MoE). Tokens travel to their
expert's rank with all-to-all (``lightning_parallel.experts``). Gradients then need two
different reductions, which DDP-style hooks cannot express, so they are explicit bucketed
all-reduces once per optimizer step (``grad_sync.py``):

- every non-expert weight: mean over all data-parallel ranks;
- an expert weight: its gradient already holds the tokens of every rank of its ep group, so
  it is *summed* over its replicas (``dp_replicate``) and divided by the data-parallel size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.grad_sync import GradientGroup, GradientSync

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule


def check_expert_arguments(expert_parallel: int, aux_loss_coef: float | None, z_loss_coef: float) -> None:
    if not isinstance(expert_parallel, int) or expert_parallel < 1:
        raise ValueError(f"`expert_parallel={expert_parallel!r}` must be a positive integer.")
    if aux_loss_coef is not None and (not isinstance(aux_loss_coef, (int, float)) or aux_loss_coef < 0):
        raise ValueError(
            f"`moe_aux_loss_coef={aux_loss_coef!r}` must be a non-negative number or None (off)."
        )
    if not isinstance(z_loss_coef, (int, float)) or z_loss_coef < 0:
        raise ValueError(f"`moe_z_loss_coef={z_loss_coef!r}` must be a non-negative number.")


class ExpertStrategyMixin:
    """Setup and per-step pieces of expert parallelism (used by ``HybridParallelStrategy``)."""

    moe_aux_loss_coef: float | None
    moe_z_loss_coef: float
    _expert_parameter_ids: set[int]
    _aux_losses: Any
    _manual_gradient_sync: GradientSync | None

    def _apply_expert_parallel(self, module: LightningModule) -> None:
        """Shard the experts of every MoE block this rank holds; set up the auxiliary-loss collector."""
        from lightning_parallel.experts import (
            AuxLossCollector,
            ExpertParallel,
            expert_parameters,
            find_moe_blocks,
        )

        dims = self.dims  # type: ignore[attr-defined]
        mesh = self.device_mesh  # type: ignore[attr-defined]
        self._expert_parameter_ids = set()
        self._aux_losses = None
        if dims.ep_enabled:
            blocks = ExpertParallel.apply(module, mesh["ep"].get_group(), token_group=mesh["dp"].get_group())
            if not blocks and not dims.pp_enabled:
                raise ValueError(
                    f"`expert_parallel={dims.expert_parallel}`: {type(module).__name__} has no Mixture-of-Experts"
                    " block (a router and a set of identical experts) to shard. Leave `expert_parallel=1`."
                )
            self._expert_parameter_ids = {id(p) for p in expert_parameters(module).values()}
            rank_zero_info(
                f"Expert parallel: {len(blocks)} MoE blocks on this rank, experts sharded over ep={dims.expert_parallel}"
            )
        blocks = find_moe_blocks(module)
        # Under pipeline parallelism the last stage cannot reach the aux losses of the MoE layers of
        # other stages, so every layer's is injected into its own backward (counted once: the
        # user's ``moe_aux_loss`` then gets 0 for it); foreign blocks only with a coefficient.
        own_layers = dims.pp_enabled and any(b.kind == "lightning_parallel" for b in blocks)
        if blocks and (self.moe_aux_loss_coef is not None or own_layers):
            group = mesh["dp"].get_group() if mesh["dp"].size() > 1 else None
            self._aux_losses = AuxLossCollector(
                module, coef=self.moe_aux_loss_coef or 0.0, z_loss_coef=self.moe_z_loss_coef, token_group=group,
                mode="backward",
            )  # fmt: skip

    def _expert_gradient_groups(self, parameters: list[torch.nn.Parameter]) -> list[GradientGroup]:
        """Data-parallel reductions of ``parameters`` (this rank's), with experts reduced over their replicas."""
        mesh = self.device_mesh  # type: ignore[attr-defined]
        dp = mesh["dp"]
        dense = [p for p in parameters if id(p) not in self._expert_parameter_ids and p.requires_grad]
        experts = [p for p in parameters if id(p) in self._expert_parameter_ids and p.requires_grad]
        groups = [GradientGroup(dense, dp.get_group(), dp.size())]
        if experts:
            replicas = mesh["dp_replicate"]
            groups.append(GradientGroup(experts, replicas.get_group(), dp.size()))
        return groups

    def _with_injected_aux(self, output: Any) -> Any:
        """The step's loss plus the aux losses injected into backward, as a constant: the reported
        loss is the one the optimiser minimises, the gradients are unchanged (already injected)."""
        collector = self._aux_losses
        if collector is None or not collector.injected:
            return output
        extra = torch.stack(collector.injected).sum()
        if isinstance(output, torch.Tensor):
            return output + extra.to(output.dtype).detach()
        if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": output["loss"] + extra.to(output["loss"].dtype).detach()}
        return output

    def _set_aux_loss_scale(self, micro_batches: int = 1) -> None:
        """Scale the injected aux gradients as the step's loss is scaled before backward:
        1 / (accumulation x micro-batches) x the fp16 loss scale."""
        if self._aux_losses is None:
            return
        scale = 1.0 / (self.lightning_module.trainer.accumulate_grad_batches * micro_batches)  # type: ignore[attr-defined]
        scaler = getattr(self.precision_plugin, "scaler", None)  # type: ignore[attr-defined]
        self._aux_losses.grad_scale = scale * float(scaler.get_scale()) if scaler is not None else scale
        self._aux_losses.reset()
