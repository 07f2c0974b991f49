"""``HybridParallelStrategy.auto(model, ...)``: the degrees and options the planner predicts fastest.

Lightning fixes the strategy's degrees inside ``Trainer(...)``, before it has seen the model, so the
choice is made where the model already exists: from the user's module (on any device, meta included),
the devices the job will have, the DataLoader's batch and the sequence length. The planner's search
(``planner/search.py``) tries every layout of those devices, keeps those whose every rank fits the
device's memory and takes the fastest; what it chose, its predicted memory and time, the runners-up and
why other families were rejected are printed (rank 0), so the choice can be read and overridden.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.config.strategy_arguments import StrategyArguments
from lightning_parallel.planner.cluster import CLUSTERS, Cluster, load_cluster
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.layout import strategy_arguments as planned_arguments
from lightning_parallel.planner.report import memory_lines, search_lines, time_lines
from lightning_parallel.planner.search import Candidate, search

__all__ = ["auto_strategy", "choose_layout", "detect_cluster", "strategy_arguments"]

_DEVICE_NAMES = (("H200", "h200"), ("H100", "h100"), ("B200", "b200"))


def detect_cluster() -> Cluster:
    """The preset of this machine's GPU; a ``ValueError`` asking for ``cluster=`` where there is none."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for marker, preset in _DEVICE_NAMES:
            if marker in name:
                return CLUSTERS[preset]
        if "A100" in name:
            memory = torch.cuda.get_device_properties(0).total_memory
            return CLUSTERS["a100-80gb" if memory > 50 * 2**30 else "a100-40gb"]
    raise ValueError(
        "HybridParallelStrategy.auto: no preset matches this machine's devices. Pass `cluster=` one of"
        f" {', '.join(CLUSTERS)}, a YAML file with their fields, or a planner Cluster."
    )


def choose_layout(
    model: nn.Module,
    devices: int,
    batch_size: int,
    sequence_length: int,
    num_nodes: int = 1,
    cluster: str | Cluster | None = None,
    precision: str = "bf16-mixed",
) -> tuple[Candidate, list[str]]:
    """The fastest layout that fits, and the report lines saying what was chosen and why."""
    machine = (
        cluster if isinstance(cluster, Cluster) else load_cluster(cluster) if cluster else detect_cluster()
    )
    if devices < machine.gpus_per_node:  # this job's nodes: tensor groups and NVLink stop at `devices`
        machine = replace(machine, gpus_per_node=devices)
    gpus = devices * num_nodes
    result = search(model, gpus, machine, None, sequence_length, precision, per_replica_batch=batch_size)
    if not result.fastest:
        raise ValueError(
            f"HybridParallelStrategy.auto: no layout of {gpus} devices fits {type(model).__name__} with batch"
            f" {batch_size} x {sequence_length} tokens per replica:\n"
            + "\n".join(search_lines(result, gpus, machine))
        )
    best = result.fastest[0]
    lines = [f"HybridParallelStrategy.auto chose {best.layout.short()} (the fastest predicted that fits):"]
    lines += memory_lines(best.layout, best.ranks, machine) + time_lines(best.time, machine)
    lines += search_lines(result, gpus, machine)
    return best, lines


def strategy_arguments(layout: Layout) -> dict[str, Any]:
    """``HybridParallelStrategy``'s keyword arguments for ``layout``: those of the planner's own record
    (``planner/layout.py: strategy_arguments``, the one the planner checked) that differ from the defaults;
    the NVMe folder is the user's to give (``strategy={"offload_path": ...}``)."""
    arguments, defaults = planned_arguments(layout), StrategyArguments()
    return {
        f.name: getattr(arguments, f.name)
        for f in dataclasses.fields(arguments)
        if f.name != "offload_path" and getattr(arguments, f.name) != getattr(defaults, f.name)
    }


def auto_strategy(cls: type, model: nn.Module, **search_arguments: Any) -> Any:
    """``cls(**arguments)`` for the layout :func:`choose_layout` picks; extra strategy arguments in ``strategy=``."""
    extra = search_arguments.pop("strategy", None) or {}
    best, lines = choose_layout(model, **search_arguments)
    rank_zero_info("\n".join(lines))
    strategy = cls(**strategy_arguments(best.layout), **extra)
    strategy.planned_layout = best.layout  # setup warns if the Trainer's devices or precision differ
    return strategy
