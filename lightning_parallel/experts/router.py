"""Routing maths: top-k choice, capacity and queue positions, the auxiliary losses.

Pure functions of tensors (no process groups, no module state), so that the rules that decide
which token goes where can be tested on hand-made inputs, and so that the single-process layer
and the expert-parallel one run literally the same code. ``Router`` is the only module here: a
gate matrix that produces the logits.

Shape legend: N tokens, E experts, K choices per token (top-k), R ranks of the token group,
B samples per rank (the first dimension of the layer's input), H model width.

Priority ("token order"). When an expert receives more tokens than its capacity, the first
``capacity`` in priority order are kept. Priority is GShard's: every token's first choice comes
before any token's second choice; within one choice, tokens come in the order of the flattened
input (sample by sample, position by position). Across the ranks of a token group, the order is
that of the global batch, see :func:`global_queue_offsets`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

TokenOrder = Literal["sample_interleaved", "rank_major"]


@dataclass
class Routing:
    """What the router decided for N tokens.

    Attributes:
        probs_NE: softmax over all experts (fp32); what the load-balancing loss differentiates.
        weights_NK: combine weight of each chosen expert (fp32): the top-k probabilities,
            renormalised to sum to 1 if ``normalize`` was set.
        experts_NK: chosen expert ids, best first (int64).
    """

    probs_NE: torch.Tensor
    weights_NK: torch.Tensor
    experts_NK: torch.Tensor


def route_topk(logits_NE: torch.Tensor, top_k: int, *, normalize: bool = False) -> Routing:
    """Softmax over experts, then the ``top_k`` most probable ones per token.

    Ties are broken towards the lower expert id (a stable descending sort, rather than
    ``torch.topk``, whose order among equal values is unspecified): the same logits route the
    same way on every rank and in every run.
    """
    num_experts = logits_NE.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"`top_k={top_k}` must be between 1 and the number of experts ({num_experts}).")
    probs_NE = torch.softmax(logits_NE.float(), dim=-1)
    sorted_NE, order_NE = torch.sort(probs_NE, dim=-1, descending=True, stable=True)
    weights_NK, experts_NK = sorted_NE[:, :top_k], order_NE[:, :top_k]
    if normalize:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return Routing(probs_NE, weights_NK, experts_NK)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Token slots per expert: ``ceil(top_k * num_tokens / num_experts * capacity_factor)``.

    Computed with exact fractions (``capacity_factor`` read as the decimal it prints as), so that
    1.25 x 8 tokens is 10, not ``ceil(10.000000000000002) = 11``.
    """
    if capacity_factor <= 0:
        raise ValueError(f"`capacity_factor={capacity_factor}` must be positive (or None for dropless).")
    exact = Fraction(repr(float(capacity_factor))) * top_k * num_tokens / num_experts
    return math.ceil(exact)


def count_values(values: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of ``0 .. size-1`` occurs in ``values``: ``bincount`` with a known length, which on a
    GPU reads the largest value back to the host first (a sync per call); this adds on the device."""
    counts = torch.zeros(size, dtype=torch.int64, device=values.device)
    return counts.scatter_add_(
        0, values.reshape(-1).long(), torch.ones_like(values.reshape(-1), dtype=torch.int64)
    )


def priority_order(experts_NK: torch.Tensor) -> torch.Tensor:
    """Expert ids of all (token, choice) assignments in priority order: ``(K * N,)``, choice-major.

    Assignment ``a = j * N + t`` is choice ``j`` of token ``t``.
    """
    return experts_NK.t().reshape(-1)


def queue_positions(experts_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Position of each assignment in its expert's queue, counting from 0 in priority order.

    Returns ``(N, K)`` int64. Sort-based (a stable sort by expert keeps priority order inside
    each expert's group), so memory is O(N * K), not O(N * K * E) as with one-hot cumsums.
    """
    flat_A = priority_order(experts_NK)
    order_A = torch.argsort(flat_A, stable=True)
    counts_E = count_values(flat_A, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_experts_A = flat_A[order_A]
    positions_sorted_A = torch.arange(flat_A.numel(), device=flat_A.device) - starts_E[sorted_experts_A]
    positions_A = torch.empty_like(positions_sorted_A)
    positions_A[order_A] = positions_sorted_A
    return positions_A.view(experts_NK.shape[1], -1).t()


def assignment_counts(experts_NK: torch.Tensor, num_experts: int, num_samples: int) -> torch.Tensor:
    """Assignments per (choice, sample, expert): ``(K, B, E)`` int64, the tokens split in B samples.

    The input to :func:`global_queue_offsets`; summed, it is tokens per expert.
    """
    num_tokens, top_k = experts_NK.shape
    if num_tokens == 0:
        return experts_NK.new_zeros(top_k, num_samples, num_experts)
    if num_tokens % num_samples:
        raise ValueError(f"{num_tokens} tokens cannot be split into {num_samples} samples of equal length.")
    tokens_per_sample = num_tokens // num_samples
    sample_N = torch.arange(num_tokens, device=experts_NK.device) // tokens_per_sample
    key_KN = (
        torch.arange(top_k, device=experts_NK.device)[:, None] * num_samples + sample_N[None, :]
    ) * num_experts + experts_NK.t()
    counts = count_values(key_KN, top_k * num_samples * num_experts)
    return counts.view(top_k, num_samples, num_experts)


def global_queue_offsets(counts_RKBE: torch.Tensor, rank: int, order: TokenOrder) -> torch.Tensor:
    """Assignments of OTHER ranks that precede this rank's ones in each queue: ``(K, B, E)``.

    ``counts_RKBE`` are :func:`assignment_counts` of every rank of the token group (all-gathered).
    The global batch is ordered as follows, and queue priority is choice-major over it:

    - ``"sample_interleaved"``: global sample ``b * R + r`` is local sample ``b`` of rank ``r``,
      which is how ``torch.utils.data.DistributedSampler`` (Lightning's data-parallel split) deals
      samples: batch ``i`` of one process over all ranks' samples equals this order.
    - ``"rank_major"``: all of rank 0's tokens, then rank 1's, ... (concatenated batches).

    A local assignment (choice j, sample b, expert e) at local queue position p has global
    position ``offset[j, b, e] + p``.
    """
    num_ranks, top_k, num_samples, num_experts = counts_RKBE.shape
    # Slices and differences, not boolean masks: a masked selection's size is read on the host on a GPU.
    per_choice_RKE = counts_RKBE.sum(2)
    earlier_choices_RKE = torch.cumsum(per_choice_RKE, 1) - per_choice_RKE  # choices j' < j
    if order == "rank_major":
        # other ranks' earlier choices, plus lower ranks' same choice
        offset_KE = earlier_choices_RKE.sum(0) - earlier_choices_RKE[rank] + per_choice_RKE[:rank].sum(0)
        return offset_KE[:, None, :].expand(top_k, num_samples, num_experts).contiguous()
    if order != "sample_interleaved":
        raise ValueError(f"`token_order={order!r}` must be 'sample_interleaved' or 'rank_major'.")
    earlier_samples_RKBE = torch.cumsum(counts_RKBE, 2) - counts_RKBE  # same choice, samples b' < b
    before_RKBE = earlier_choices_RKE[:, :, None, :] + earlier_samples_RKBE
    others_KBE = before_RKBE.sum(0) - before_RKBE[rank]
    return others_KBE + counts_RKBE[:rank].sum(0)  # lower ranks: also sample b itself


def load_balancing_loss(
    probs_NE: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    total_tokens: int,
    top_k: int,
    replicas: int = 1,
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_i f_i * P_i``: 1.0 for perfectly even routing.

    ``f_i`` is the fraction of assignments routed to expert i, before capacity drops
    (``tokens_per_expert_E / (top_k * total_tokens)``, so that it sums to 1 for any k; Hugging
    Face's Mixtral sums ``f`` to k, i.e. its value is k times this one), and ``P_i`` the mean
    router probability of expert i. ``f`` carries no gradient; ``P`` does.

    Over a token group of ``replicas`` ranks, pass the group's counts and token total: this rank
    returns ``E * sum_i f_i * (replicas / total_tokens) * sum_local p_i``, whose mean over the ranks
    (what data-parallel gradient averaging computes) is exactly the loss of the global batch.
    """
    num_experts = probs_NE.shape[-1]
    total_tokens = max(total_tokens, 1)  # no tokens: a loss of 0 (an empty sum), not a division by 0
    f_E = tokens_per_expert_E.detach().to(probs_NE.dtype) / (top_k * total_tokens)
    p_E = probs_NE.sum(0) * (replicas / total_tokens)
    return num_experts * torch.sum(f_E * p_E)


def router_z_loss(
    logits_NE: torch.Tensor, total_tokens: int | None = None, replicas: int = 1
) -> torch.Tensor:
    """ST-MoE's router z-loss, the mean of ``logsumexp(logits)^2``: keeps router logits small.

    Over a token group, as for :func:`load_balancing_loss`: scaled so the ranks' mean is the
    global mean.
    """
    total = logits_NE.shape[0] if total_tokens is None else total_tokens
    z_N = torch.logsumexp(logits_NE.float(), dim=-1)
    return (z_N**2).sum() * (replicas / max(total, 1))


class Router(nn.Module):
    """The gate: one ``(E, H)`` matrix whose product with a token gives its expert logits.

    Runs in fp32 even under autocast: the softmax over experts and the top-k choice are
    sensitive to rounding (bf16 logits tie often), and the matrix is small.
    """

    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x_NH.device.type, enabled=False):
            return F.linear(x_NH.float(), self.weight.float())  # (N, E)
