"""A plan as text, as JSON for tools, and as a picture: memory per rank by kind, and the step's time budget.

One model feeds all three (``memory.py``, ``timing.py``), as it feeds the search and the plan the
strategy prints at setup.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.memory import RankMemory
from lightning_parallel.planner.search import USABLE_MEMORY, SearchResult
from lightning_parallel.planner.timing import StepTime

__all__ = ["dumps", "memory_lines", "plan_json", "render_plan", "search_json", "search_lines", "time_lines"]

GIB = 2**30
_KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers")
_COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer": "#55A868",
    "activations": "#C44E52",
    "buffers": "#8172B3",
}


def _unit(largest: float) -> tuple[str, int]:
    """The unit a table of sizes up to ``largest`` bytes reads best in."""
    for name, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, size
    return "B", 1


def memory_lines(layout: Layout, ranks: list[RankMemory], cluster: Cluster | None = None) -> list[str]:
    """A table of bytes per distinct rank, the device total beside the device's memory."""
    unit, size = _unit(max(r.device_total for r in ranks))
    lines = [
        f"memory per rank ({unit}), {layout.short()}, {layout.precision}, sequence {layout.sequence_length}:"
    ]
    header = f"  {'rank':<40}" + "".join(f"{k[:11]:>12}" for k in _KINDS) + f"{'device':>10}{'host':>8}"
    lines.append(header)
    for rank in ranks:
        cells = "".join(f"{getattr(rank, k) / size:>12.2f}" for k in _KINDS)
        label = rank.label + (f" (+{len(rank.notes)} alike)" if rank.notes else "")
        lines.append(f"  {label:<40}{cells}{rank.device_total / size:>10.2f}{rank.host_total / size:>8.2f}")
    if cluster is not None:
        worst = max(ranks, key=lambda r: r.device_total)
        usable = USABLE_MEMORY * cluster.memory_bytes  # what the search allows: the allocator needs the rest
        verdict = (
            "fits" if worst.device_total <= usable else f"DOES NOT FIT in the {USABLE_MEMORY:.0%} usable"
        )
        lines.append(
            f"  most loaded: {worst.label}, {_size(worst.device_total)} of {_size(cluster.memory_bytes)}"
            f" on {cluster.name}: {verdict}"
        )
    return lines


def _size(num_bytes: float) -> str:
    unit, size = _unit(num_bytes)
    return f"{num_bytes / size:.1f} {unit}"


def time_lines(time: StepTime, cluster: Cluster) -> list[str]:
    terms = ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.1f}" for k, v in time.breakdown().items() if v)
    return [
        f"step time on {cluster.name}: {time.total * 1e3:.1f} ms ({terms} ms)",
        f"  {time.tokens_per_s:,.0f} tokens/s, MFU {time.mfu:.1%}, {time.model_flops_per_gpu / 1e12:.0f} model"
        f" TFLOP/s per GPU ({time.hardware_flops_per_gpu / 1e12:.0f} with recomputation)",
    ]


def search_lines(result: SearchResult, gpus: int, cluster: Cluster) -> list[str]:
    lines = [f"fastest layouts that fit on {gpus} x {cluster.name} ({result.tried} tried):"]
    for i, c in enumerate(result.fastest, 1):
        lines.append(
            f"  {i:>2}. {c.layout.short():<48} {c.time.tokens_per_s:>12,.0f} tokens/s  MFU {c.time.mfu:>5.1%}"
            f"  peak {_size(c.peak.device_total)} ({c.peak.label})"
        )
    if not result.fastest:
        lines.append("  none: every family below fails")
    if result.rejected:
        lines.append("families rejected:")
        lines += [f"  {family}: {why}" for family, why in result.rejected.items()]
    return lines


def plan_json(
    layout: Layout, ranks: list[RankMemory], time: StepTime | None = None, cluster: Cluster | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"layout": layout.as_dict(), "ranks": [r.as_dict() for r in ranks]}
    if time is not None and cluster is not None:
        out["cluster"] = cluster.name
        out["time"] = {
            **time.breakdown(),
            "total": time.total,
            "tokens_per_s": time.tokens_per_s,
            "mfu": time.mfu,
        }
    return out


def search_json(result: SearchResult) -> dict[str, Any]:
    return {
        "fastest": [
            {
                "layout": c.layout.as_dict(),
                "tokens_per_s": c.time.tokens_per_s,
                "mfu": c.time.mfu,
                "step_s": c.time.total,
                "peak_bytes": c.peak.device_total,
                "peak_rank": c.peak.label,
            }
            for c in result.fastest
        ],
        "rejected": result.rejected,
        "tried": result.tried,
    }


def dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=1, default=str)


def render_plan(
    path: str | Path,
    layout: Layout,
    ranks: list[RankMemory],
    time: StepTime | None = None,
    cluster: Cluster | None = None,
) -> Path:
    """A PNG: stacked bars of memory per rank by kind (the device's memory as a line), and the step's terms."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:  # matplotlib is an optional dependency of this project
        raise ImportError("the plan's picture needs matplotlib: pip install matplotlib") from err
    panels = 2 if time is not None else 1
    fig = Figure(figsize=(max(6.0, 1.2 * len(ranks) + 3), 4.0 * panels), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(panels, 1, 1)
    labels = [r.label.replace(", ", "\n") for r in ranks]
    bottom = [0.0] * len(ranks)
    for kind in _KINDS:
        values = [getattr(r, kind) / GIB for r in ranks]
        ax.bar(labels, values, bottom=bottom, label=kind, color=_COLORS[kind])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    if cluster is not None:
        ax.axhline(cluster.memory_bytes / GIB, color="black", linestyle="--", label=f"{cluster.name} memory")
    ax.set_ylabel("GiB")
    ax.set_title(f"memory per rank: {layout.short()}, {layout.precision}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if time is not None:
        ax2 = fig.add_subplot(panels, 1, 2)
        terms = {k: v * 1e3 for k, v in time.breakdown().items() if v}
        left = 0.0
        for i, (name, value) in enumerate(terms.items()):
            ax2.barh(["step"], [value], left=left, label=name, color=f"C{i}")
            left += value
        ax2.set_xlabel("ms")
        ax2.set_title(
            f"step {time.total * 1e3:.1f} ms, {time.tokens_per_s:,.0f} tokens/s, MFU {time.mfu:.1%}",
            fontsize=10,
        )
        ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
