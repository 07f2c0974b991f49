"""Human-readable plan: what gets sharded how, and parameter bytes per rank.

Users read this before paying for a large job, so it lists every sharded module with its
style, the attributes rewritten for local shards, what stays replicated and why, and the
parameter memory per rank against the unsharded model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from lightning_parallel.plans.plan import ParallelPlan


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"


def record_parameter_shards(plan: ParallelPlan, model: nn.Module) -> None:
    """Remember global and local sizes of every parameter (call after sharding)."""
    plan.parameter_shards = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        plan.parameter_shards[name] = (param.numel(), local.numel(), param.element_size())


def format_plan(plan: ParallelPlan) -> str:
    lines = [
        f"ParallelPlan(tensor_parallel={plan.tensor_parallel}, sequence_parallel={plan.sequence_parallel})"
    ]
    if plan.block_list is not None:
        lines.append(f"  block stack: {plan.block_list} ({len(plan.block_names)} blocks)")
    width = max((len(name) for name in plan.styles), default=10)
    lines.append("  sharded modules:")
    for name, style in plan.styles.items():
        lines.append(f"    {name:<{width}}  {style!r}")
    for container in plan.containers:
        if container.scaled_attributes or container.narrow_input:
            attrs = ", ".join(f"{k} {g}->{loc}" for k, (g, loc) in container.scaled_attributes.items())
            mode = "width-sliced input" if container.narrow_input else "full-width input"
            lines.append(f"    {container.name}: {container.kind}, {mode}" + (f"; {attrs}" if attrs else ""))
    for note in plan.notes:
        lines.append(f"  note: {note}")
    if plan.parameter_shards:
        total = sum(g * b for g, _, b in plan.parameter_shards.values())
        local = sum(loc * b for _, loc, b in plan.parameter_shards.values())
        lines.append(
            f"  parameters per rank: {_human(local)} of {_human(total)} unsharded"
            f" ({local / max(total, 1):.1%}); gradients the same; Adam states 2x that in fp32"
        )
    return "\n".join(lines)
