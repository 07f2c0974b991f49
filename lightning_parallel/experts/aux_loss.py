"""MoE auxiliary losses that reach the optimiser without the user adding them, counted once.

For the strategy (one collector per model, built after ``ExpertParallel.apply``)::

    collector = AuxLossCollector(model, coef=0.01, token_group=dp_group)
    # every training step (every micro-batch under gradient accumulation):
    collector.reset()                       # before the user's training_step
    out = user_training_step(batch)         # forward: routers record their losses
    loss = collector.add_to_loss(out_loss)  # + the step's auxiliary losses, then backward(loss)

What is added, per MoE block that ran a training forward (``module.training`` and grad enabled)
since ``reset``:

- foreign blocks (Hugging Face fused, router + ModuleList): ``coef * aux + z_loss_coef * z`` from
  the router's logits, with ``aux`` Switch's ``E * sum_i f_i * P_i`` (``router.load_balancing_loss``:
  f sums to 1 for any k) and ``z`` the router z-loss; summed over blocks (Switch, Megatron,
  DeepSpeed sum over layers; Hugging Face's ``router_aux_loss_coef`` instead multiplies ONE loss
  pooled over layers, and its f sums to k).
- this library's ``MoE`` layers: their own ``take_aux_loss()`` (their ``aux_loss_coef`` and
  ``z_loss_coef``); a layer whose loss the user already took in ``training_step``
  (``moe_aux_loss(model)``) contributes 0.

Counted once: a Hugging Face model whose forward already added its own aux loss to its returned
loss (``output_router_logits=True`` and labels passed: its ``aux_loss`` and ``loss`` are both set)
makes ``add_to_loss`` skip the foreign blocks for that step, with a warning.

With ``token_group`` (the data-parallel group), routing fractions are counted over the global
batch, so the ranks' mean is the single-process loss of the whole batch (``router.py``).

``mode="backward"`` is for pipelines, where a stage's blocks cannot reach the last stage's loss:
each block's weighted loss is attached to its own output's backward (Megatron's
``MoEAuxLossAutoScaler``): the backward adds ``grad_scale * d(aux)/d(theta)``, the gradient of
``grad_scale * aux`` as a loss term. The strategy sets ``collector.grad_scale`` to what the main
loss is multiplied by before backward (1 / accumulation or micro-batches, times the fp16 loss
scale); ``add_to_loss`` then adds nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from lightning_parallel.experts.detection import MoEBlockInfo, find_moe_blocks
from lightning_parallel.experts.dispatch import ProcessGroup, group_size, report_group_mean, sum_over_group
from lightning_parallel.experts.layer import MoE
from lightning_parallel.experts.router import count_values, load_balancing_loss, route_topk, router_z_loss


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on ``x``; in backward, gives ``aux`` the gradient ``scale`` (as if added to the loss)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (aux,) = ctx.saved_tensors
        # a tensor scale stays on the device
        return (
            grad,
            (torch.ones_like(aux) * ctx.scale).to(aux.dtype),
            None,
        )


class AuxLossCollector:
    """Collect MoE auxiliary losses during forward; add them to the loss once (module docstring).

    Args:
        model: The model (unchanged, or after ``ExpertParallel.apply``).
        coef: Weight of the load-balancing loss of foreign blocks.
        z_loss_coef: Weight of the router z-loss of foreign blocks.
        token_group: Count routing over this group's global batch (the data-parallel group).
        sequence_group: Under sequence parallelism, the tensor-parallel ranks, each routing its slice of the
            sequence: counted with ``token_group``, and since their gradients are summed (not averaged)
            each injects its share divided by their number.
        mode: ``"loss"``: ``add_to_loss`` adds them; ``"backward"``: injected into each block's
            backward with ``grad_scale``.

    Raises ``ValueError`` if ``model`` has no MoE block, or a foreign block's top-k is unknown.
    """

    def __init__(
        self,
        model: nn.Module,
        coef: float = 0.01,
        z_loss_coef: float = 0.0,
        token_group: ProcessGroup | None = None,
        mode: Literal["loss", "backward"] = "loss",
        sequence_group: ProcessGroup | None = None,
    ) -> None:
        if mode not in ("loss", "backward"):
            raise ValueError(f"AuxLossCollector: `mode={mode!r}` must be 'loss' or 'backward'.")
        self.blocks = find_moe_blocks(model)
        if not self.blocks:
            raise ValueError(
                f"AuxLossCollector: {type(model).__name__} has no MoE block (see find_moe_blocks)."
            )
        self.coef, self.z_loss_coef, self.mode = coef, z_loss_coef, mode
        self.token_group = token_group if group_size(token_group) > 1 else None
        self.sequence_group = sequence_group if group_size(sequence_group) > 1 else None
        self.grad_scale: float | torch.Tensor = 1.0
        # backward mode: the (detached) weighted losses injected since ``reset``, for reporting
        self.injected: list[torch.Tensor] = []
        self._pending: list[torch.Tensor] = []
        self._model_added_its_own = False
        self._warned = False
        self._handles = []
        for info in self.blocks:
            if info.kind == "lightning_parallel":
                if mode == "backward":
                    self._handles.append(info.block.register_forward_hook(self._inject_layer))
            else:
                if info.top_k is None:
                    raise ValueError(f"AuxLossCollector: cannot tell top-k of MoE block {info.name!r}.")
                self._handles.append(info.router.register_forward_hook(self._router_hook(info)))
        for module in model.modules():
            if hasattr(module, "router_aux_loss_coef"):  # a Hugging Face MoE model with its own aux loss
                self._handles.append(module.register_forward_hook(self._detect_own_aux))

    # ---- hooks -----------------------------------------------------------------------------

    def _router_hook(self, info: MoEBlockInfo) -> Callable:
        def hook(router: nn.Module, args: Any, output: Any) -> Any:
            if not (info.block.training and torch.is_grad_enabled()):
                return None
            read, differentiated = info.router_outputs
            logits = output[read] if isinstance(output, tuple) else output
            # a router may score classes beyond the experts (zero experts): dropped
            logits = logits.reshape(-1, logits.shape[-1])[:, : info.num_experts]
            loss = self._foreign_loss(logits, info.top_k)
            if self.mode == "loss":
                self._pending.append(loss)
                return None
            # backward mode: attach to an output that the block's combine step differentiates
            # (HF routers return (logits, weights, indices) and the block discards the logits)
            self.injected.append(loss.detach().reshape(()))
            scale = self.grad_scale / group_size(self.sequence_group)  # summed over the sequence's ranks
            if isinstance(output, tuple) and len(output) >= 2:
                injected = list(output)
                injected[differentiated] = _InjectAuxGrad.apply(output[differentiated], loss, scale)
                return tuple(injected)
            return _InjectAuxGrad.apply(output, loss, scale)

        return hook

    def _foreign_loss(self, logits_NE: torch.Tensor, top_k: int) -> torch.Tensor:
        routing = route_topk(logits_NE.detach(), top_k)
        probs_NE = torch.softmax(logits_NE.float(), dim=-1)
        counts_E = count_values(routing.experts_NK, logits_NE.shape[-1])
        counts_E = sum_over_group(sum_over_group(counts_E, self.token_group), self.sequence_group)
        replicas = group_size(self.token_group) * group_size(self.sequence_group)
        total = logits_NE.shape[0] if replicas == 1 else int(counts_E.sum()) // top_k
        aux = load_balancing_loss(probs_NE, counts_E, total, top_k, replicas)
        loss = self.coef * aux
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * router_z_loss(logits_NE, total, replicas)
        return loss

    def _inject_layer(self, layer: MoE, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not (layer.training and torch.is_grad_enabled()):
            return None
        aux = layer.take_aux_loss()
        self.injected.append(aux.detach().reshape(()))
        return _InjectAuxGrad.apply(output, aux, self.grad_scale)

    def _detect_own_aux(self, module: nn.Module, args: Any, output: Any) -> None:
        if getattr(output, "aux_loss", None) is not None and getattr(output, "loss", None) is not None:
            self._model_added_its_own = True

    # ---- the strategy's calls -----------------------------------------------------------------

    def reset(self) -> None:
        """Forget what earlier forwards recorded; call before each training step / micro-batch."""
        self._pending.clear()
        self.injected.clear()
        self._model_added_its_own = False
        for info in self.blocks:
            if info.kind == "lightning_parallel":
                info.block.take_aux_loss()

    def start_step(self, grad_scale: float | torch.Tensor) -> None:
        """Before a training step: forget the last one; ``grad_scale`` is how the step's loss is scaled
        before backward (1 / (accumulation x micro-batches), times the fp16 loss scale), which the
        injected gradients must follow."""
        self.grad_scale = grad_scale
        self.reset()

    def with_injected(self, output: Any) -> Any:
        """A step's output (a loss, or a dict with ``"loss"``) plus the losses injected into backward, as a
        constant: the reported loss is the one the optimiser minimises, the gradients are unchanged.
        The constant is the injected losses' mean over ``token_group`` (``dispatch.report_group_mean``).
        """
        if not self.injected:
            return output
        share = report_group_mean(torch.stack(self.injected).sum(), self.token_group)
        extra = report_group_mean(share, self.sequence_group)
        if isinstance(output, torch.Tensor):
            return output + extra.to(output.dtype).detach()
        if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": output["loss"] + extra.to(output["loss"].dtype).detach()}
        return output

    def total(self) -> torch.Tensor | None:
        """The weighted sum that :meth:`add_to_loss` would add now (consumes nothing), or None."""
        parts = [] if self._model_added_its_own else list(self._pending)
        parts += [
            b.block._pending_aux
            for b in self.blocks
            if b.kind == "lightning_parallel" and b.block._pending_aux is not None
        ]
        return torch.stack([p.reshape(()) for p in parts]).sum() if parts else None

    def add_to_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus the auxiliary losses recorded since :meth:`reset`, each counted once."""
        if self.mode == "backward":
            return loss
        if self._model_added_its_own and self._pending and not self._warned:
            warnings.warn(
                "AuxLossCollector: the Hugging Face model already added its router aux loss to its returned loss"
                " (output_router_logits=True with labels); the collector adds nothing for its blocks.",
                stacklevel=2,
            )
            self._warned = True
        total = self.total()
        self._pending.clear()
        for info in self.blocks:
            if info.kind == "lightning_parallel":
                info.block.take_aux_loss()
        return loss if total is None else loss + total.to(loss.dtype)

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
