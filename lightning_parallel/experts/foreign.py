"""Expert parallelism for MoE blocks in models nobody here wrote, without editing the model.

The blocks are found by ``detection.find_moe_blocks``; ``parallel.ExpertParallel.apply`` calls these:

- fused: only the experts module's ``forward`` is replaced (instance attribute). The block still
  routes with its own code; the new forward sends each (token, choice) row to the rank holding
  its expert, where the experts' ORIGINAL forward runs on the local weight slice with each row
  given its local expert id and weight 1, and weights the returned rows with the block's
  routing weights. Whatever the experts compute (activation, gating, bias, transposed layout,
  HF's eager/grouped_mm/batched_mm implementations) is therefore reproduced, not re-implemented.
- module_list: the block's routing lives in its ``forward``, which loops over experts; it is
  replaced (instance attribute) by softmax/top-k routing with this library's dispatch, plus a
  ``shared_expert`` (gated by a ``shared_expert_gate`` if present) as in Qwen-MoE. Whether the
  top-k weights are renormalised (``norm_topk_prob``, or tried both ways) and what the block
  returns are decided by running the original forward and the replacement on the same random
  input first: a block whose output cannot be reproduced raises ``ValueError`` naming it.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from lightning_parallel.experts.detection import MoEBlockInfo
from lightning_parallel.experts.dispatch import ProcessGroup, dispatch, group_rank, group_size
from lightning_parallel.experts.router import route_topk

# ---- fused experts (transformers 5) --------------------------------------------------------------


def check_fused_experts(info: MoEBlockInfo) -> None:
    """Refuse fused experts whose output is not each assignment's expert output times its routing weight:
    expert parallelism runs each assignment on its expert's rank with weight 1 and weighs it afterwards.
    (ERGO normalises the experts' weighted sum: a norm inside the experts module.)"""
    experts = info.experts
    stacked = next(experts.parameters())
    hidden = next((m.in_features for m in info.block.modules() if isinstance(m, nn.Linear)), None)
    router = getattr(info.block, info.router_name or "", None)
    weight = getattr(router, "weight", None)
    hidden = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else hidden
    if hidden is None or stacked.is_meta:
        return
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(6, hidden, generator=generator).to(stacked)
    index = torch.stack([torch.arange(6) % info.num_experts, (torch.arange(6) + 1) % info.num_experts], 1)
    weights = (torch.rand(6, 2, generator=generator) + 0.5).to(stacked)
    index = index.to(stacked.device)
    with torch.no_grad():
        whole = experts(x, index, weights).reshape(6, -1)  # DBRX's come back (tokens, 1, width)
        ones = torch.ones(6, 1, dtype=stacked.dtype, device=stacked.device)
        parts = sum(
            weights[:, k : k + 1] * experts(x, index[:, k : k + 1], ones).reshape(6, -1) for k in range(2)
        )
    if not torch.allclose(whole, parts, rtol=1e-4, atol=1e-5):
        raise ValueError(
            f"`expert_parallel`: the experts of `{info.name}` ({type(experts).__name__}) do not return the sum of"
            " each assignment's expert output times its routing weight (a norm or another step over the weighted"
            " sum inside them), which expert parallelism needs to run each assignment on its expert's rank."
            " Use expert_parallel=1 (tensor, pipeline and data parallelism and ZeRO apply)."
        )


def adapt_fused_experts(info: MoEBlockInfo, ep_group: ProcessGroup) -> None:
    """Give a fused experts module expert parallelism; its stacked weights must be sliced already."""
    experts = info.experts
    original = experts.forward  # bound method of the class (HF's implementation dispatcher)
    num_experts, size = info.num_experts, group_size(ep_group)
    if hasattr(experts, "num_experts"):
        experts.num_experts = num_experts // size  # the original forward indexes the local slice

    def forward(
        self: nn.Module,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        hidden_NH = hidden.reshape(num_tokens, -1)  # DBRX hands its experts (batch, sequence, width)

        def compute(x_MH: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
            local_M = torch.repeat_interleave(torch.arange(counts_L.numel(), device=x_MH.device), counts_L)
            ones = torch.ones(x_MH.shape[0], 1, dtype=top_k_weights.dtype, device=x_MH.device)
            y_MH = original(x_MH, local_M[:, None], ones, *args, **kwargs).reshape(x_MH.shape)
            if x_MH.shape[0] == 0:  # keep the weights in the graph: zero gradients, not None
                y_MH = y_MH + sum(p.sum() for p in self.parameters()) * 0
            return y_MH

        token_A = torch.arange(num_tokens * top_k, device=hidden_NH.device) // top_k
        y_AH = dispatch(hidden_NH, token_A, top_k_index.reshape(-1), num_experts, compute, ep_group)
        y_AH = y_AH * top_k_weights.reshape(-1, 1).to(y_AH.dtype)
        return y_AH.view(num_tokens, top_k, -1).sum(1).to(hidden.dtype).view(hidden.shape)

    experts.forward = types.MethodType(forward, experts)


# ---- router + ModuleList blocks ------------------------------------------------------------------


def _module_list_forward(
    info: MoEBlockInfo, ep_group: ProcessGroup | None, *, normalize: bool, returns_logits: bool
):
    block, num_experts = info.block, info.num_experts
    top_k = info.top_k

    def forward(self: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        x_NH = hidden.reshape(-1, hidden.shape[-1])
        num_tokens = x_NH.shape[0]
        logits_NE = getattr(self, info.router_name)(x_NH)
        routing = route_topk(logits_NE, top_k, normalize=normalize)
        local = list(getattr(self, info.experts_name).children())

        def compute(x_MH: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
            outs = [expert(chunk) for expert, chunk in zip(local, x_MH.split(counts_L.tolist()), strict=True)]
            return torch.cat(outs)

        token_A = torch.arange(num_tokens * top_k, device=x_NH.device) // top_k
        y_AH = dispatch(x_NH, token_A, routing.experts_NK.reshape(-1), num_experts, compute, ep_group)
        y_AH = y_AH * routing.weights_NK.reshape(-1, 1).to(y_AH.dtype)
        out_NH = y_AH.view(num_tokens, top_k, -1).sum(1).to(hidden.dtype)
        shared = getattr(self, "shared_expert", None)
        if shared is not None:
            gate = getattr(self, "shared_expert_gate", None)
            shared_NH = shared(x_NH)
            out_NH = out_NH + (shared_NH if gate is None else torch.sigmoid(gate(x_NH)) * shared_NH)
        out = out_NH.view(hidden.shape)
        return (out, logits_NE) if returns_logits else out

    return types.MethodType(forward, block)


def _first_tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


@torch.no_grad()
def check_module_list(info: MoEBlockInfo) -> None:
    """Decide, by running both, how the replacement forward must route; ``ValueError`` if no way fits.

    Sets ``info.normalize_top_k`` and ``info.returns_logits``. Runs the original forward once on a
    seeded random ``(2, 8, H)`` input in eval mode (no router jitter), all experts local.
    """
    block = info.block
    router = info.router
    label = info.name or type(block).__name__
    if info.top_k is None:
        raise ValueError(
            f"ExpertParallel: cannot tell top-k of MoE block {label!r} (no top_k/num_experts_per_tok)."
        )
    width = router.in_features
    param = next(router.parameters())
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 8, width, generator=generator).to(param.device, param.dtype)
    was_training = block.training
    block.eval()
    try:
        want = block(x)
        returns_logits = isinstance(want, (tuple, list))
        declared = getattr(block, "norm_topk_prob", None)
        for normalize in [bool(declared)] if declared is not None else [True, False]:
            got = _module_list_forward(info, None, normalize=normalize, returns_logits=returns_logits)(x)
            if torch.allclose(_first_tensor(got), _first_tensor(want), rtol=1e-4, atol=1e-5):
                info.normalize_top_k, info.returns_logits = normalize, returns_logits
                return
    finally:
        block.train(was_training)
    raise ValueError(
        f"ExpertParallel: MoE block {label!r} ({type(block).__name__}) routes differently from softmax top-{info.top_k}"
        f" over {info.num_experts} experts (with or without renormalisation), so its forward cannot be"
        " replaced by an expert-parallel one. Wrap its experts in lightning_parallel.experts.MoE instead."
    )


def adapt_module_list(info: MoEBlockInfo, ep_group: ProcessGroup) -> None:
    """Keep only this rank's experts (global indices kept in their names) and patch the forward."""
    if info.normalize_top_k is None:
        check_module_list(info)
    size, rank = group_size(ep_group), group_rank(ep_group)
    num_local = info.num_experts // size
    keep = {str(i) for i in range(rank * num_local, (rank + 1) * num_local)}
    experts = info.experts
    for key in list(experts._modules):
        if key not in keep:
            del experts._modules[key]
    info.block.forward = _module_list_forward(
        info, ep_group, normalize=info.normalize_top_k, returns_logits=info.returns_logits
    )
