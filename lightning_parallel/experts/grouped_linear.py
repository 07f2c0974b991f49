"""Expert linears on rows grouped by expert (ScatterMoE's and MegaBlocks' convention), under expert parallelism.

JetMoE's blocks route, sort the token copies by expert, and call each expert linear as
``linear(rows, rows_per_expert)`` with an ``(E, out, in)`` weight, applying the activation, the routing
weights and the combination themselves (its MLP: ``input_linear``, activation, ``output_linear``; its
mixture of attention heads: ``input_linear`` makes each expert's queries, attention runs, ``output_linear``
writes back). Under expert parallelism each such linear's ``forward`` is replaced: its rows travel to the
rank holding their expert, the linear's original forward runs there on its slice of the weight with the
local experts' row counts, and the results come back in the rows' order. Everything between the linears
stays on the token's rank, so nothing of the block is re-implemented; each linear is one exchange out and
back (two per block where a fused experts module needs one).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from lightning_parallel.experts.detection import MoEBlockInfo
from lightning_parallel.experts.dispatch import ProcessGroup, dispatch, group_size

__all__ = ["adapt_grouped_linears", "check_grouped_linears"]


@torch.no_grad()
def check_grouped_linears(info: MoEBlockInfo) -> None:
    """Refuse linears whose rows are not each their expert's matrix times that row (the replaced forward runs
    each expert's rows wherever that expert is), and a router whose outputs are not laid out as expected
    (its logits read by the load-balancing loss, its routing weights the gradient goes into)."""
    label = f"`{info.name}` ({type(info.block).__name__})"
    problems = []
    generator = torch.Generator(device="cpu").manual_seed(0)
    counts = [2 + (e % 2) for e in range(info.num_experts)]
    for name in info.grouped_names:
        linear = getattr(info.block, name)
        weight = next(p for p in linear.parameters(recurse=False) if p.dim() == 3)
        if weight.is_meta:
            continue
        rows = torch.randn(sum(counts), weight.shape[-1], generator=generator).to(weight)
        whole = linear(rows, counts)
        starts = [sum(counts[:e]) for e in range(info.num_experts)]
        for expert in range(info.num_experts):
            alone = [c if e == expert else 0 for e, c in enumerate(counts)]
            got = linear(rows[starts[expert] : starts[expert] + counts[expert]], alone)
            if not torch.allclose(
                got, whole[starts[expert] : starts[expert] + counts[expert]], rtol=1e-4, atol=1e-5
            ):
                problems.append(f"`{name}`'s rows of expert {expert} depend on other experts' rows")
                break
    router = info.router
    linear = next((m for m in router.modules() if isinstance(m, nn.Linear)), None)
    weight = linear.weight if linear is not None else getattr(router, "weight", None)
    if weight is not None and not weight.is_meta:
        tokens = torch.randn(4, weight.shape[-1], generator=generator).to(weight)
        out = router(tokens)
        read, differentiated = info.router_outputs
        if not (
            isinstance(out, tuple)
            and len(out) > max(read, differentiated)
            and isinstance(out[read], torch.Tensor)
            and out[read].shape == (4, info.num_experts)
            and isinstance(out[differentiated], torch.Tensor)
            and out[differentiated].is_floating_point()
        ):
            problems.append("its router does not return (order, token, weight, counts, logits)")
    if problems:
        raise ValueError(
            f"`expert_parallel`: the expert linears of {label} take rows grouped by expert, and "
            f"{'; '.join(problems)}. Use expert_parallel=1 (tensor, pipeline and data parallelism and ZeRO apply)."
        )


def _expert_parallel_forward(linear: nn.Module, num_experts: int, ep_group: ProcessGroup) -> None:
    original = linear.forward
    if hasattr(linear, "num_experts"):
        linear.num_experts = num_experts // group_size(ep_group)  # the original loops over the local slice

    def forward(
        self: nn.Module, rows: torch.Tensor, rows_per_expert: list[int] | torch.Tensor
    ) -> torch.Tensor:
        counts_E = torch.as_tensor(rows_per_expert, device=rows.device)
        expert_A = torch.repeat_interleave(torch.arange(num_experts, device=rows.device), counts_E)
        order_A = torch.arange(rows.shape[0], device=rows.device)

        def compute(x_MH: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
            out = original(x_MH, counts_L.tolist())
            if x_MH.shape[0] == 0:  # keep the weight in the graph: a zero gradient, not None
                out = out + sum(p.sum() for p in self.parameters()) * 0
            return out

        return dispatch(rows, order_A, expert_A, num_experts, compute, ep_group)

    linear.forward = types.MethodType(forward, linear)


def adapt_grouped_linears(info: MoEBlockInfo, ep_group: ProcessGroup) -> None:
    """Give each expert linear of the block expert parallelism; their weights must be sliced already."""
    for name in info.grouped_names:
        _expert_parallel_forward(getattr(info.block, name), info.num_experts, ep_group)
