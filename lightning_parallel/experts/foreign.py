"""MoE blocks in models nobody here wrote: finding them, and giving them expert parallelism.

Found structurally, not by class name (``find_moe_blocks``):

- ``"lightning_parallel"``: this library's ``MoE``.
- ``"fused"``: a block with a router (a child ``nn.Linear(H, E)``, or a child holding an
  ``(E, H)`` ``weight`` as Hugging Face's ``MixtralTopKRouter``) and an experts child whose
  parameters are 3-D tensors with E leading (transformers 5's ``MixtralExperts``,
  ``Qwen2MoeExperts``: ``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``), called as
  ``experts(hidden_NH, top_k_index_NK, top_k_weights_NK)``.
- ``"prescaled"``: fused experts called as ``experts(rows)`` on inputs the block has already weighted by
  the router's scores, one group per expert (Llama 4; ``prescaled.py``).
- ``"module_list"``: a block with a router ``nn.Linear(H, E)`` and an ``nn.ModuleList`` of E
  modules of one class with equal parameter shapes (transformers 4's Mixtral, most hand-written
  MoEs).

Expert parallelism without editing the model (``parallel.ExpertParallel.apply`` calls these):

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

import inspect
import re
import types
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lightning_parallel.experts.dispatch import ProcessGroup, dispatch, group_rank, group_size
from lightning_parallel.experts.layer import MoE
from lightning_parallel.experts.router import route_topk

BlockKind = Literal["lightning_parallel", "fused", "module_list", "prescaled"]
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "k", "topk", "moe_top_k")
_EXPERT_COUNT_ATTRS = ("num_experts", "n_routed_experts", "num_local_experts")
SHARD_ATTR = "_lp_expert_shard"  # set on expert parameters by parallel.ExpertParallel.apply
_ROUTER_NAME = re.compile(r"gate|router|gating", re.IGNORECASE)


@dataclass
class MoEBlockInfo:
    """One MoE block found in a model.

    Attributes:
        name: Qualified module name of the block ("" for the root).
        block: The block module.
        kind: ``"lightning_parallel"``, ``"fused"`` or ``"module_list"`` (module docstring).
        num_experts: Routed experts E (global, as built).
        top_k: Experts per token if the block or its router says (``top_k``,
            ``num_experts_per_tok``, ...), else None.
        router_name: Child name of the router in the block (``"router"``, ``"gate"``, ...).
        experts_name: Child name of the experts in the block.
        expert_param_names: Qualified names of the expert parameters (not router, not shared).
        normalize_top_k: For ``module_list`` blocks, the renormalisation the verification chose.
        returns_logits: For ``module_list`` blocks: the original forward returns
            ``(output, router_logits)``.
        rows_per_expert: For fused experts stored as 2-D stacks of row blocks (DBRX), each expert's rows.
        router_outputs: Which of a router's outputs are its logits, and which one the block differentiates
            (the load-balancing loss reads the first and injects its gradient into the second).
    """

    name: str
    block: nn.Module
    kind: BlockKind
    num_experts: int
    top_k: int | None
    router_name: str | None
    experts_name: str
    expert_param_names: list[str] = field(default_factory=list)
    normalize_top_k: bool | None = None
    returns_logits: bool = False
    rows_per_expert: int = 1
    router_outputs: tuple[int, int] = (0, 1)

    @property
    def router(self) -> nn.Module | None:
        return None if self.router_name is None else getattr(self.block, self.router_name)

    @property
    def experts(self) -> nn.Module:
        return getattr(self.block, self.experts_name)


def _router_experts(module: nn.Module) -> dict[str, int]:
    """Children that look like a router: name -> number of experts they score.

    A router is named like one (``gate``, ``router``, ``gating``, in its attribute or class name)
    and is an ``nn.Linear``, a module with its own 2-D ``(E, H)`` weight (not an embedding; children
    without one, such as ERNIE 4.5's correction-bias statistics, allowed), or a module around one
    ``nn.Linear`` that scores the experts (AFMoE's ``router.gate``, DBRX's ``router.layer``). A router
    that declares its expert count (``num_experts``) is taken at its word: it may score more classes
    than experts (Inkling's shared-expert gates, LongCat-Flash's zero experts, Zaya's skip expert, which
    the block itself maps onto real experts with weight 0) or be a small network of several linears
    (Zaya's).
    """
    found = {}
    for name, child in module.named_children():
        if not (_ROUTER_NAME.search(name) or _ROUTER_NAME.search(type(child).__name__)):
            continue
        linears = [m for m in child.modules() if isinstance(m, nn.Linear)]
        weight = child._parameters.get("weight")
        declared = next(
            (getattr(child, a) for a in _EXPERT_COUNT_ATTRS if isinstance(getattr(child, a, None), int)), 0
        )
        if declared > 1 and not isinstance(declared, bool) and (linears or isinstance(weight, torch.Tensor)):
            found[name] = declared
        elif isinstance(child, nn.Linear) and child.out_features > 1:
            found[name] = child.out_features
        elif isinstance(weight, torch.Tensor) and not isinstance(child, nn.Embedding) and not linears:
            if weight.dim() == 2 and weight.shape[0] > 1:
                found[name] = weight.shape[0]
        elif weight is None and len(linears) == 1 and linears[0].out_features > 1:
            found[name] = linears[0].out_features
    return found


def _identical(modules: list[nn.Module]) -> bool:
    first = modules[0]
    shapes = [tuple(p.shape) for p in first.parameters()]
    return bool(shapes) and all(
        type(m) is type(first) and [tuple(p.shape) for p in m.parameters()] == shapes for m in modules[1:]
    )


def _global_experts(param: torch.Tensor, local: int) -> int:
    """Experts of the block as built: after ``ExpertParallel.apply`` a rank holds fewer."""
    shard = getattr(param, SHARD_ATTR, None)
    return local if shard is None else shard.num_experts


def _top_k(block: nn.Module, router: nn.Module | None) -> int | None:
    for owner in (block, router):
        for attr in _TOP_K_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def per_expert(param: torch.Tensor, count: int, rows: int = 1) -> bool:
    """A stacked per-expert tensor of a fused experts module: a weight ``(E, ., .)``, or a bias ``(E, F)``
    (GPT-OSS) whose leading dim is the expert count ``count`` of its weights; with ``rows`` per expert, a
    2-D stack of the experts' row blocks ``(E * rows, .)`` (DBRX)."""
    return param.dim() >= 3 or (param.dim() == 2 and param.shape[0] == count * rows)


def _row_blocks(child: nn.Module, counts: set[int]) -> tuple[int, int] | None:
    """Experts stored as 2-D stacks of row blocks, one per expert, in a child of the experts module (DBRX's
    ``experts.mlp.w1`` ``(E * F, H)``, viewed ``(E, F, H)`` by its code): ``(E, F)`` for an expert count
    ``E`` some router scores, else None."""
    params = list(child.parameters())
    if not params or any(p.dim() != 2 for p in params):
        return None
    for count in sorted(counts, reverse=True):
        rows = {p.shape[0] // count for p in params if p.shape[0] % count == 0}
        if len(rows) == 1 and all(p.shape[0] % count == 0 for p in params) and rows != {1}:
            return count, rows.pop()
    return None


def _match(prefix: str, block: nn.Module) -> MoEBlockInfo | None:
    if isinstance(block, MoE):
        names = [f"{prefix}experts.{n}" for n, _ in block.experts.named_parameters()]
        return MoEBlockInfo(prefix.rstrip("."), block, "lightning_parallel", block.num_experts, block.top_k,
                            "router", "experts", names)  # fmt: skip
    routers = _router_experts(block)
    for name, child in block.named_children():
        if isinstance(child, nn.ModuleList) and len(child) > 1 and _identical(list(child)):
            kind: BlockKind = "module_list"
            num_experts = _global_experts(next(child.parameters()), len(child))
        else:
            arguments = len(inspect.signature(child.forward).parameters)
            stacked = [p for p in child.parameters(recurse=False) if p.dim() >= 3]
            if name in routers or arguments == 2 or (arguments == 1 and not stacked):
                continue  # a router; or not called with (hidden, top_k_index, top_k_weights), nor with (hidden)
            blocks = None if stacked or arguments == 1 else _row_blocks(child, set(routers.values()))
            if arguments == 1 and len({p.shape[0] for p in stacked}) == 1:  # fed rows the router weighted
                kind, num_experts = "prescaled", _global_experts(stacked[0], stacked[0].shape[0])
            elif arguments == 1:
                continue
            elif blocks is not None:
                num_experts, rows = blocks
                shard = getattr(next(child.parameters()), SHARD_ATTR, None)
                kind, num_experts = "fused", num_experts if shard is None else shard.num_experts
            elif not stacked or len({p.shape[0] for p in stacked}) != 1:
                continue
            else:
                kind, num_experts = "fused", _global_experts(stacked[0], stacked[0].shape[0])
        router_names = [r for r, n in routers.items() if n == num_experts and r != name]
        if not router_names:
            continue
        router_name = router_names[0]
        if kind == "module_list" and not isinstance(getattr(block, router_name), nn.Linear):
            continue
        rows = blocks[1] if kind != "module_list" and blocks is not None else 1
        local = next((p.shape[0] for p in child.parameters(recurse=False) if p.dim() >= 3), 0)
        if rows > 1:
            local = next(child.parameters()).shape[0] // rows
        params = [
            f"{prefix}{name}.{n}"
            for n, p in child.named_parameters()
            if kind == "module_list" or per_expert(p, local, rows)
        ]
        outputs = (1, 0) if kind == "prescaled" else (0, 1)  # Llama 4's router returns (scores, logits)
        return MoEBlockInfo(prefix.rstrip("."), block, kind, num_experts,
                            _top_k(block, getattr(block, router_name)), router_name, name, params,
                            rows_per_expert=rows, router_outputs=outputs)  # fmt: skip
    return None


def find_moe_blocks(model: nn.Module) -> list[MoEBlockInfo]:
    """Every MoE block in ``model`` (itself included), outermost match first, never nested."""
    found: list[MoEBlockInfo] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name == t or name.startswith(t + ".") for t in taken):
            continue
        info = _match(f"{name}." if name else "", module)
        if info is not None:
            found.append(info)
            taken.append(name)
    return found


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

    def forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
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
    info: MoEBlockInfo, ep_group: ProcessGroup | None, normalize: bool, returns_logits: bool
):
    block, num_experts = info.block, info.num_experts
    top_k = info.top_k

    def forward(self: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        x_NH = hidden.reshape(-1, hidden.shape[-1])
        num_tokens = x_NH.shape[0]
        logits_NE = getattr(self, info.router_name)(x_NH)
        routing = route_topk(logits_NE, top_k, normalize)
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
            got = _module_list_forward(info, None, normalize, returns_logits)(x)
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
    info.block.forward = _module_list_forward(info, ep_group, info.normalize_top_k, info.returns_logits)
