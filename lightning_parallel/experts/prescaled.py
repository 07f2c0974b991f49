"""Experts that receive their input already weighted by the router (Llama 4), under expert parallelism.

Llama 4's MoE block multiplies each token by its routing score *before* the experts, ``routed_in[e * N + n] =
x[n] * score[n, e]`` (the score is 0 for experts the token did not select), and calls ``experts(routed_in)``
on all ``E * N`` rows, one equal group per expert. The output is not linear in the score, so the fused
adapter's "run with weight 1, weigh afterwards" (``foreign.py``) would be wrong; but the rows the block
built are exactly what each selected expert must see. Under expert parallelism the replaced forward sends
only the selected rows (token ``n``'s top-k experts, read from the router's logits as the router chose them)
to the ranks holding their experts, runs the experts' original forward there on groups padded to equal size
with zero rows, and puts each result back at its row; the rows of unselected experts are 0, as the original
computes them: an expert without a bias maps a zero row to zero, and neither it nor its weights get a
gradient from it (:func:`check_prescaled_experts` verifies both before anything changes).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from lightning_parallel.experts.detection import MoEBlockInfo
from lightning_parallel.experts.dispatch import ProcessGroup, dispatch, group_size

__all__ = ["adapt_prescaled_experts", "check_prescaled_experts"]

_TOKENS_PER_EXPERT = 3  # rows per expert in the check's input


def _hidden_size(info: MoEBlockInfo) -> int:
    weight = getattr(info.router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"`expert_parallel`: cannot tell the width the router of `{info.name}` reads.")
    return weight.shape[-1]


@torch.no_grad()
def check_prescaled_experts(info: MoEBlockInfo) -> None:
    """Refuse experts or routers that break what the replaced forward relies on: a zero row maps to zero, an
    expert's rows depend on its group only, and the router returns ``(scores, logits)`` with scores zero
    outside the top-k of the logits."""
    experts, router, count, top_k = info.experts, info.router, info.num_experts, info.top_k
    stacked = next(experts.parameters())
    if stacked.is_meta:
        return
    label = f"`{info.name}` ({type(experts).__name__})"
    hidden = _hidden_size(info)
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(count * _TOKENS_PER_EXPERT, hidden, generator=generator).to(stacked)
    problems = []
    if not torch.equal(experts(torch.zeros_like(x)), torch.zeros_like(x)):
        problems.append("they map a zero row to something else (a bias)")
    whole = experts(x).view(count, _TOKENS_PER_EXPERT, -1)
    for expert in range(count):
        alone = torch.zeros_like(x).view(count, _TOKENS_PER_EXPERT, -1)
        alone[expert] = x.view(count, _TOKENS_PER_EXPERT, -1)[expert]
        if not torch.allclose(
            experts(alone.view_as(x)).view_as(whole)[expert], whole[expert], rtol=1e-4, atol=1e-5
        ):
            problems.append(f"expert {expert}'s rows depend on other experts' rows")
            break
    out = router(x[:_TOKENS_PER_EXPERT])
    if not (isinstance(out, tuple) and len(out) >= 2 and top_k is not None):
        problems.append("the router does not return (scores, logits)")
    else:
        scores, logits = out[0], out[1]
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(
            1, logits.topk(top_k, dim=1).indices, True
        )
        if scores.shape != logits.shape or bool((scores[~chosen] != 0).any()):
            problems.append("the router's scores are not zero outside the top-k of its logits")
    if problems:
        raise ValueError(
            f"`expert_parallel`: the experts of {label} take inputs the router weighted, and {'; '.join(problems)}:"
            " expert parallelism sends only each token's selected rows. Use expert_parallel=1 (tensor, pipeline"
            " and data parallelism and ZeRO apply)."
        )


def adapt_prescaled_experts(info: MoEBlockInfo, ep_group: ProcessGroup) -> None:
    """Give prescaled experts expert parallelism; their stacked weights must be sliced already."""
    experts, router = info.experts, info.router
    assert router is not None and info.top_k is not None
    original = experts.forward
    num_experts, top_k = info.num_experts, info.top_k
    num_local = num_experts // group_size(ep_group)
    if hasattr(experts, "num_experts"):
        experts.num_experts = num_local
    seen: list[torch.Tensor] = []  # the router's logits of the call the experts are about to serve
    logits_at = info.router_outputs[0]

    def keep_logits(module: nn.Module, args: Any, output: Any) -> None:
        seen[:] = [output[logits_at].detach()]

    router.register_forward_hook(keep_logits)

    def forward(self: nn.Module, routed_in: torch.Tensor) -> torch.Tensor:
        if not seen:
            raise RuntimeError(
                f"`expert_parallel`: the experts of `{info.name}` ran without their router first."
            )
        logits_NE = seen[-1]
        num_tokens, hidden = logits_NE.shape[0], routed_in.shape[-1]
        experts_NK = logits_NE.topk(top_k, dim=1).indices  # what the router chose, on the same logits
        expert_A = experts_NK.reshape(-1)
        token_A = torch.arange(num_tokens, device=routed_in.device).repeat_interleave(top_k)
        row_A = expert_A * num_tokens + token_A

        def compute(x_MH: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
            if x_MH.shape[0] == 0:  # keep the weights in the graph: zero gradients, not None
                return x_MH + sum(p.sum() for p in self.parameters()) * 0
            local_M = torch.repeat_interleave(torch.arange(num_local, device=x_MH.device), counts_L)
            starts_L = torch.cumsum(counts_L, 0) - counts_L
            position_M = torch.arange(x_MH.shape[0], device=x_MH.device) - starts_L[local_M]
            width = int(counts_L.max())
            padded = x_MH.new_zeros(num_local, width, hidden).index_put((local_M, position_M), x_MH)
            return original(padded.view(-1, hidden)).view(num_local, width, -1)[local_M, position_M]

        y_AH = dispatch(routed_in, row_A, expert_A, num_experts, compute, ep_group)
        return routed_in.new_zeros(routed_in.shape[0], y_AH.shape[-1]).index_copy(
            0, row_A, y_AH.to(routed_in.dtype)
        )

    experts.forward = types.MethodType(forward, experts)
