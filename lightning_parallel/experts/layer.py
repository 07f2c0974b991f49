"""``MoE``: a drop-in replacement for a transformer's MLP: router, experts, dispatch, statistics.

    moe = MoE(dim=512, hidden_dim=1024, num_experts=8, top_k=2, capacity_factor=1.25)
    y = moe(x)                      # (..., 512) -> (..., 512), like the dense MLP it replaces
    loss = task_loss + moe.take_aux_loss()   # or moe_aux_loss(model) for every MoE layer

Semantics (docs/experts.md has the long form):

- Routing: softmax over experts, the ``top_k`` best (ties to the lower id); combine weights are
  those probabilities, renormalised to sum to 1 if ``normalize_top_k`` (GShard/Mixtral; leave it
  off for ``top_k=1``, where it would make every weight 1 and starve the router of gradient).
- Capacity: with ``capacity_factor`` c, each expert takes ``ceil(top_k * tokens / experts * c)``
  assignments; the rest are dropped in priority order (all first choices before any second
  choice, then token order). A dropped assignment contributes zero; a token whose every choice
  is dropped leaves the layer as zeros, i.e. passes through the caller's residual unchanged.
  ``capacity_factor=None`` is dropless.
- Token group: with expert parallelism (``ExpertParallel.apply(..., token_group=dp_group)``),
  "tokens" above means the global batch of the group's ranks, so a layer split over ranks drops
  exactly the assignments the same layer would drop in one process on the whole batch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.experts.dispatch import (
    ProcessGroup,
    dispatch,
    gather_counts,
    group_rank,
    group_size,
    report_group_mean,
)
from lightning_parallel.experts.experts import Activation, GroupedExperts
from lightning_parallel.experts.router import (
    Router,
    Routing,
    TokenOrder,
    assignment_counts,
    expert_capacity,
    global_queue_offsets,
    load_balancing_loss,
    priority_order,
    queue_positions,
    route_topk,
    router_z_loss,
)


@dataclass
class _Queues:
    """Capacity decisions for one forward, over the token group."""

    keep_NK: torch.Tensor | None  # None: every assignment kept
    tokens_per_expert_E: torch.Tensor  # assignments per expert before drops, over the group
    total_tokens: int  # tokens in the group's batch
    replicas: int  # ranks in the token group
    dropped: torch.Tensor  # fraction of the group's assignments dropped


def plan_queues(
    experts_NK: torch.Tensor,
    num_experts: int,
    num_samples: int,
    capacity_factor: float | None,
    token_group: ProcessGroup | None = None,
    token_order: TokenOrder = "sample_interleaved",
) -> _Queues:
    """Which assignments fit in their expert's capacity, counted over the token group."""
    top_k = experts_NK.shape[1]
    counts_KBE = assignment_counts(experts_NK, num_experts, num_samples)
    replicas = group_size(token_group)
    counts_RKBE = counts_KBE[None] if replicas == 1 else gather_counts(counts_KBE, token_group)
    tokens_per_expert_E = counts_RKBE.sum((0, 1, 2))
    # Every token has one first choice; over a token group the ranks' counts are read (a host sync).
    total_tokens = experts_NK.shape[0] if replicas == 1 else int(counts_RKBE[:, 0].sum())
    if capacity_factor is None:
        return _Queues(
            None, tokens_per_expert_E, total_tokens, replicas, experts_NK.new_zeros((), dtype=torch.float)
        )
    capacity = expert_capacity(total_tokens, num_experts, top_k, capacity_factor)
    positions_NK = queue_positions(experts_NK, num_experts)
    if replicas > 1 and experts_NK.shape[0] > 0:
        offsets_KBE = global_queue_offsets(counts_RKBE, group_rank(token_group), token_order)
        sample_N = torch.arange(experts_NK.shape[0], device=experts_NK.device) // (
            experts_NK.shape[0] // num_samples
        )
        choice_K = torch.arange(top_k, device=experts_NK.device)
        positions_NK = positions_NK + offsets_KBE[choice_K[None, :], sample_N[:, None], experts_NK]
    dropped = (tokens_per_expert_E - capacity).clamp(min=0).sum().float() / max(top_k * total_tokens, 1)
    return _Queues(positions_NK < capacity, tokens_per_expert_E, total_tokens, replicas, dropped)


class SharedExpert(nn.Module):
    """A dense MLP every token goes through (DeepSeek/Qwen-MoE's shared expert), ``nn.Linear``s."""

    def __init__(self, dim: int, hidden_dim: int, activation: Activation, *, bias: bool) -> None:
        super().__init__()
        self.activation = activation
        self.fc = nn.Linear(dim, hidden_dim, bias=bias)
        self.up = nn.Linear(dim, hidden_dim, bias=bias) if activation == "swiglu" else None
        self.proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.up is not None:
            h = F.silu(h) * self.up(x)
        else:
            h = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[self.activation](h)
        return self.proj(h)


class MoE(nn.Module):
    """Mixture-of-Experts MLP. See the module docstring for the routing and capacity rules.

    Args:
        dim: Model width H (input and output).
        hidden_dim: Hidden width of each expert.
        num_experts: Routed experts E.
        top_k: Experts per token (1: Switch, 2: GShard/Mixtral).
        capacity_factor: Slots per expert relative to an even split; ``None``: dropless.
        normalize_top_k: Renormalise the chosen experts' probabilities to sum to 1.
        activation: ``"gelu"``, ``"swiglu"``, ``"relu"`` or ``"silu"``.
        bias: Biases in the expert (and shared expert) projections.
        shared_expert_hidden_dim: Width of an always-on dense expert added to the output.
        aux_loss_coef: Weight of the Switch load-balancing loss in :meth:`take_aux_loss`.
        z_loss_coef: Weight of the router z-loss in :meth:`take_aux_loss`.
        token_order: How ranks' batches form the global batch for capacity priority, see
            ``router.global_queue_offsets`` (default: as ``DistributedSampler`` deals samples).

    Statistics of the last training forward (non-persistent buffers, detached):
    ``tokens_per_expert`` (assignments per expert before drops, over the token group),
    ``dropped_fraction``, ``aux_loss``, ``z_loss``.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int = 2,
        *,
        capacity_factor: float | None = None,
        normalize_top_k: bool = False,
        activation: Activation = "gelu",
        bias: bool = False,
        shared_expert_hidden_dim: int | None = None,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        token_order: TokenOrder = "sample_interleaved",
    ) -> None:
        super().__init__()
        _validate(num_experts, top_k, capacity_factor, token_order)
        if top_k == 1 and normalize_top_k:
            warnings.warn(
                "MoE(top_k=1, normalize_top_k=True): every combine weight becomes 1.0 and the router gets"
                " no gradient from the task loss (Switch uses the raw probability). Set normalize_top_k=False.",
                stacklevel=2,
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.normalize_top_k = capacity_factor, normalize_top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.token_order: TokenOrder = token_order
        self.router = Router(dim, num_experts)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, activation, bias=bias)
        self.shared_expert = (
            SharedExpert(dim, shared_expert_hidden_dim, activation, bias=bias)
            if shared_expert_hidden_dim
            else None
        )
        # Set by ExpertParallel.apply; None: every expert here, statistics of the local batch only.
        self.ep_group: ProcessGroup | None = None
        self.token_group: ProcessGroup | None = None
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("dropped_fraction", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        self.register_buffer("z_loss", torch.zeros(()), persistent=False)
        self._pending_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = x.shape[-1]
        x_NH = x.reshape(-1, dim)
        num_tokens = x_NH.shape[0]
        num_samples = x.shape[0] if x.dim() > 2 else num_tokens
        # 1. route: probabilities, the top-k experts and their combine weights
        logits_NE = self.router(x_NH)
        routing = route_topk(logits_NE, self.top_k, normalize=self.normalize_top_k)
        # 2. capacity: which assignments fit, counted over the token group's global batch
        queues = plan_queues(
            routing.experts_NK,
            self.num_experts,
            num_samples,
            self.capacity_factor,
            self.token_group,
            self.token_order,
        )
        # 3. auxiliary losses, kept until taken (take_aux_loss / AuxLossCollector)
        self._record(logits_NE, routing, queues)
        # 4. kept assignments to their experts (local, or all-to-all over ep_group) and back
        flat_A = priority_order(routing.experts_NK)
        weights_A = priority_order(routing.weights_NK)
        kept_A = None if queues.keep_NK is None else priority_order(queues.keep_NK).nonzero().squeeze(1)
        ids_A = torch.arange(flat_A.numel(), device=x.device) if kept_A is None else kept_A
        y_AH = dispatch(
            x_NH, ids_A % num_tokens, flat_A[ids_A], self.num_experts, self.experts, self.ep_group
        )
        # 5. combine: weight each expert output, sum a token's choices (dropped ones are zero)
        y_AH = y_AH * weights_A[ids_A, None].to(y_AH.dtype)
        if kept_A is not None:
            y_AH = y_AH.new_zeros(flat_A.numel(), dim).index_copy(0, kept_A, y_AH)
        out_NH = y_AH.view(self.top_k, num_tokens, dim).sum(0)
        # 6. shared expert: every token, no routing
        if self.shared_expert is not None:
            out_NH = out_NH + self.shared_expert(x_NH)
        return out_NH.view(x.shape[:-1] + (out_NH.shape[-1],))

    def _record(self, logits_NE: torch.Tensor, routing: Routing, queues: _Queues) -> None:
        if not (self.training and torch.is_grad_enabled()):
            return
        aux = load_balancing_loss(
            routing.probs_NE, queues.tokens_per_expert_E, queues.total_tokens, self.top_k, queues.replicas
        )
        z = router_z_loss(logits_NE, queues.total_tokens, queues.replicas)
        self._pending_aux = self.aux_loss_coef * aux + self.z_loss_coef * z
        self.tokens_per_expert.copy_(queues.tokens_per_expert_E)
        self.dropped_fraction.copy_(queues.dropped)
        self.aux_loss.copy_(aux.detach())
        self.z_loss.copy_(z.detach())

    def take_aux_loss(self) -> torch.Tensor:
        """``aux_loss_coef * aux + z_loss_coef * z`` of the last training forward, once.

        A second call (or an ``AuxLossCollector`` after the user's own call) gets 0: the loss is
        counted once whoever adds it. Only the last forward is kept: a module called twice in one
        step contributes its last call's losses.
        """
        pending, self._pending_aux = self._pending_aux, None
        return self.router.weight.new_zeros(()) if pending is None else pending

    def extra_repr(self) -> str:
        capacity = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return f"num_experts={self.num_experts}, top_k={self.top_k}, {capacity}"


def _validate(num_experts: int, top_k: int, capacity_factor: float | None, token_order: str) -> None:
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"MoE: `num_experts={num_experts!r}` must be a positive integer.")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"MoE: `top_k={top_k!r}` must be between 1 and num_experts={num_experts}.")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(
            f"MoE: `capacity_factor={capacity_factor!r}` must be positive, or None for dropless."
        )
    if token_order not in ("sample_interleaved", "rank_major"):
        raise ValueError(f"MoE: `token_order={token_order!r}` must be 'sample_interleaved' or 'rank_major'.")


def moe_layers(module: nn.Module) -> list[MoE]:
    """Every :class:`MoE` inside ``module`` (itself included), in registration order."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def moe_aux_loss(module: nn.Module) -> torch.Tensor:
    """Sum of :meth:`MoE.take_aux_loss` over every MoE layer in ``module``: add it to the loss.

    Its value is the mean over the layers' token group, its gradient this rank's share
    (``dispatch.report_group_mean``).
    """
    layers = moe_layers(module)
    if not layers:
        raise ValueError(f"moe_aux_loss: {type(module).__name__} contains no lightning_parallel MoE layer.")
    share = torch.stack([layer.take_aux_loss() for layer in layers]).sum()
    return report_group_mean(share, layers[0].token_group)
