"""MoE blocks in models nobody here wrote, found structurally, not by class name (``find_moe_blocks``).

- ``"lightning_parallel"``: this library's ``MoE``.
- ``"fused"``: a block with a router (a child ``nn.Linear(H, E)``, or a child holding an ``(E, H)`` ``weight``
  as Hugging Face's ``MixtralTopKRouter``; or one that declares ``num_experts``) and an experts child whose
  parameters are 3-D tensors with E leading (transformers 5's ``MixtralExperts``: ``gate_up_proj (E, 2I, H)``,
  ``down_proj (E, H, I)``), or 2-D stacks of E row blocks one level down (DBRX's ``experts.mlp.w1``), called
  as ``experts(hidden_NH, top_k_index_NK, top_k_weights_NK)``.
- ``"prescaled"``: fused experts called as ``experts(rows)`` on inputs the block has already weighted by the
  router's scores, one group per expert (Llama 4; ``prescaled.py``).
- ``"grouped_linear"``: expert linears called as ``linear(rows_grouped_by_expert, rows_per_expert)`` with an
  ``(E, out, in)`` weight, the block routing, grouping and combining around them (JetMoE's MLP and its
  mixture of attention heads; ``grouped_linear.py``).
- ``"module_list"``: a block with a router ``nn.Linear(H, E)`` and an ``nn.ModuleList`` of E modules of one
  class with equal parameter shapes (transformers 4's Mixtral, most hand-written MoEs).

How each kind gets expert parallelism: ``foreign.py`` (fused, module list), ``prescaled.py``,
``grouped_linear.py``.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from lightning_parallel.experts.layer import MoE

BlockKind = Literal["lightning_parallel", "fused", "module_list", "prescaled", "grouped_linear"]
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
        kind: ``"lightning_parallel"``, ``"fused"``, ``"prescaled"``, ``"grouped_linear"`` or ``"module_list"``
            (module docstring).
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
        grouped_names: For ``grouped_linear`` blocks, every expert linear of the block (``experts_name`` the
            first).
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
    grouped_names: tuple[str, ...] = ()

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
    shard = getattr(params[0], SHARD_ATTR, None)
    if shard is not None:  # sliced by expert parallelism: the mark says what the stack was
        return (shard.num_experts, shard.rows_per_expert) if shard.rows_per_expert > 1 else None
    for count in sorted(counts, reverse=True):
        rows = {p.shape[0] // count for p in params if p.shape[0] % count == 0}
        if len(rows) == 1 and all(p.shape[0] % count == 0 for p in params) and rows != {1}:
            return count, rows.pop()
    return None


def _match(prefix: str, block: nn.Module) -> MoEBlockInfo | None:
    if isinstance(block, MoE):
        names = [f"{prefix}experts.{n}" for n, _ in block.experts.named_parameters()]
        return MoEBlockInfo(
            prefix.rstrip("."),
            block,
            "lightning_parallel",
            block.num_experts,
            block.top_k,
            "router",
            "experts",
            names,
        )
    routers = _router_experts(block)
    grouped = _grouped_linears(block, routers)
    if grouped is not None:
        return _grouped_info(prefix, block, routers, grouped)
    for name, child in block.named_children():
        if isinstance(child, nn.ModuleList) and len(child) > 1 and _identical(list(child)):
            kind: BlockKind = "module_list"
            num_experts = _global_experts(next(child.parameters()), len(child))
        else:
            arguments = len(inspect.signature(child.forward).parameters)
            stacked = [p for p in child.parameters(recurse=False) if p.dim() >= 3]
            if name in routers or arguments == 2 or (arguments == 1 and not stacked):
                continue  # a router; or not called with (hidden, top_k_index, top_k_weights), nor with (hidden)
            routed = _routed_call(child)
            blocks = None if stacked or not routed else _row_blocks(child, set(routers.values()))
            if arguments == 1 and _expert_stacks(child, stacked):  # fed rows the router weighted
                kind, num_experts = "prescaled", _global_experts(stacked[0], stacked[0].shape[0])
            elif arguments == 1:
                continue
            elif blocks is not None:
                kind, (num_experts, rows) = "fused", blocks
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
        return MoEBlockInfo(
            prefix.rstrip("."),
            block,
            kind,
            num_experts,
            _top_k(block, getattr(block, router_name)),
            router_name,
            name,
            params,
            rows_per_expert=rows,
            router_outputs=outputs,
        )
    return None


_NOT_EXPERTS = (nn.Bilinear, nn.modules.conv._ConvNd)  # 3-D weights of one module, not a stack of experts


def _expert_stacks(child: nn.Module, stacked: list[torch.Tensor]) -> bool:
    """Two or more 3-D weights with one leading size, in a module that is no convolution or bilinear map."""
    return (
        not isinstance(child, _NOT_EXPERTS) and len(stacked) >= 2 and len({p.shape[0] for p in stacked}) == 1
    )


def _routed_call(child: nn.Module) -> bool:
    """Called with the routing as transformers' experts modules are: ``(hidden, top_k_index, top_k_weights)``."""
    names = list(inspect.signature(child.forward).parameters)[1:3]
    return len(names) == 2 and bool(re.search("ind", names[0])) and "weight" in names[1]


def _grouped_linears(block: nn.Module, routers: dict[str, int]) -> list[str] | None:
    """Children called as ``linear(rows_grouped_by_expert, rows_per_expert)`` with an ``(E, out, in)`` weight
    for an E a router of the block scores (ScatterMoE's and MegaBlocks' convention: JetMoE's
    ``input_linear``/``output_linear``, in its MLP and its mixture of attention heads)."""
    names = []
    for name, child in block.named_children():
        stacked = [p for p in child.parameters(recurse=False) if p.dim() == 3]
        if (
            name in routers
            or not stacked
            or any(True for _ in child.children())
            or isinstance(child, _NOT_EXPERTS)
        ):
            continue
        experts = _global_experts(stacked[0], stacked[0].shape[0])  # sliced by expert parallelism: as built
        if len(inspect.signature(child.forward).parameters) == 2 and experts in routers.values():
            names.append(name)
    return names or None


def _grouped_info(
    prefix: str, block: nn.Module, routers: dict[str, int], names: list[str]
) -> MoEBlockInfo | None:
    stacked = next(p for p in getattr(block, names[0]).parameters(recurse=False) if p.dim() == 3)
    num_experts = _global_experts(stacked, stacked.shape[0])
    router_names = [r for r, n in routers.items() if n == num_experts]
    if not router_names:
        return None
    params = [f"{prefix}{name}.{n}" for name in names for n, _ in getattr(block, name).named_parameters()]
    return MoEBlockInfo(
        prefix.rstrip("."),
        block,
        "grouped_linear",
        num_experts,
        _top_k(block, getattr(block, router_names[0])),
        router_names[0],
        names[0],
        params,
        router_outputs=(4, 2),
        grouped_names=tuple(names),
    )


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
