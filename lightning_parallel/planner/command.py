"""The planner's part of ``python -m lightning_parallel plan``: memory per rank, step time, search.

    python -m lightning_parallel plan --model recipes.gpt.module.GPTLightningModule --init '{...}' \\
        --tensor-parallel 8 --pipeline-parallel 4 --data-parallel 16 --zero-stage 1 \\
        --micro-batch-size 1 --micro-batches 16 --sequence-length 4096 --precision bf16-mixed --cluster h100
    python -m lightning_parallel plan --model ... --search --gpus 512 --cluster h100 --global-batch 1024

The model is built on the meta device (no memory), so a 405B model plans on a laptop.
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from lightning_parallel.config.arguments import resolve_schedule, virtual_stages_for
from lightning_parallel.planner.cluster import CLUSTERS, Cluster, load_cluster
from lightning_parallel.planner.layout import PRECISIONS, Layout, layout_problems
from lightning_parallel.planner.memory import rank_memory
from lightning_parallel.planner.report import (
    memory_lines,
    plan_json,
    render_plan,
    search_json,
    search_lines,
    time_lines,
)
from lightning_parallel.planner.search import search
from lightning_parallel.planner.shapes import describe
from lightning_parallel.planner.timing import step_time
from lightning_parallel.planner.validation import expected_error

__all__ = ["add_planner_arguments", "layout_from_arguments", "run_planner"]


def add_planner_arguments(plan: argparse.ArgumentParser) -> None:
    group = plan.add_argument_group("memory and time (the planner)")
    group.add_argument("--data-parallel", type=int, default=None, help="data-parallel replicas (default 1)")
    group.add_argument("--expert-parallel", type=int, default=None)
    group.add_argument(
        "--context-parallel", type=int, default=None, help="ranks splitting each sequence (of dp)"
    )
    group.add_argument("--context-parallel-mode", choices=("ring", "ulysses"), default=None)
    group.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2, 3))
    group.add_argument("--offload", choices=("cpu", "nvme"), default=None)
    group.add_argument("--activation-checkpointing", choices=("full", "selective"), default=None)
    group.add_argument(
        "--activation-checkpointing-policy",
        choices=("ops", "ops_alternate_matmuls"),
        default=None,
        help="with selective: keep every matmul output (ops) or every second projection's (ops_alternate_matmuls)",
    )
    group.add_argument(
        "--activation-compression",
        choices=("bf16", "fp8"),
        default=None,
        help="store the activations saved for backward in 2 or 1 bytes an element",
    )
    group.add_argument(
        "--activation-offload",
        action="store_true",
        default=None,
        help="keep the activations saved for backward in host memory (all but each micro-batch's last block)",
    )
    group.add_argument("--precision", choices=sorted(PRECISIONS), default=None, help="default bf16-mixed")
    group.add_argument(
        "--micro-batch-size", type=int, default=1, help="sequences per micro-batch (default 1)"
    )
    group.add_argument("--micro-batches", type=int, default=None, help="per step (default: pipeline ranks)")
    group.add_argument("--sequence-length", type=int, default=None, help="tokens per sequence (default 2048)")
    group.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "adafactor"), default="adamw")
    group.add_argument(
        "--cluster", default=None, help=f"a preset ({', '.join(CLUSTERS)}) or a YAML file: adds the step time"
    )
    group.add_argument(
        "--search", action="store_true", help="list the fastest layouts that fit (needs --gpus)"
    )
    group.add_argument("--gpus", type=int, default=None, help="devices to search layouts for")
    group.add_argument("--global-batch", type=int, default=None, help="sequences per step, for --search")
    group.add_argument("--top", type=int, default=10, help="layouts --search lists")
    group.add_argument("--json", action="store_true", help="print JSON instead of text")
    group.add_argument(
        "--png", default=None, help="also draw memory per rank and the step's time into this PNG"
    )


def layout_from_arguments(args: argparse.Namespace, strategy: dict[str, Any], tp: int, *, sp: bool) -> Layout:
    """The layout of the command line, completed by the config's ``trainer.strategy`` where it is silent."""

    def pick(flag: Any, key: str, default: Any) -> Any:
        return flag if flag is not None else strategy.get(key, default)

    pp = args.pipeline_parallel or strategy.get("pipeline_parallel") or 1
    virtual = args.pipeline_virtual_stages or strategy.get("pipeline_virtual_stages")
    schedule = args.pipeline_schedule or strategy.get("pipeline_schedule") or "1f1b"
    if pp > 1:  # the strategy's defaults: stages per rank by the schedule, micro-batches one per stage
        spec = resolve_schedule(schedule)
        schedule, virtual = spec.name, virtual_stages_for(spec, virtual)
    else:
        virtual = 1
    data_parallel = args.data_parallel or strategy.get("data_parallel")
    devices, nodes = strategy.get("_devices"), strategy.get("_num_nodes", 1)
    if data_parallel is None and isinstance(devices, int) and isinstance(nodes, int):
        # the config's Trainer: what is left for replicas
        data_parallel = max(devices * nodes // (tp * pp), 1)
    return Layout(
        tensor_parallel=tp,
        sequence_parallel=sp,
        pipeline_parallel=pp,
        pipeline_schedule=schedule,
        pipeline_virtual_stages=virtual,
        micro_batches=pick(args.micro_batches, "micro_batches", None) or pp * virtual,
        data_parallel=data_parallel or 1,
        expert_parallel=pick(args.expert_parallel, "expert_parallel", 1),
        context_parallel=pick(args.context_parallel, "context_parallel", 1),
        context_parallel_mode=pick(args.context_parallel_mode, "context_parallel_mode", "ring"),
        zero_stage=pick(args.zero_stage, "zero_stage", 0),
        offload=pick(args.offload, "offload", None),
        # a config's own ZeRO options (no flags of their own: the config file is where they are set)
        zero_engine=strategy.get("zero_engine", "auto"),
        zero_gather_dtype=strategy.get("zero_gather_dtype", "stored"),
        activation_checkpointing=pick(args.activation_checkpointing, "activation_checkpointing", None),
        activation_checkpointing_policy=_policy(
            pick(args.activation_checkpointing_policy, "activation_checkpointing_policy", None)
        ),
        activation_offload=bool(pick(args.activation_offload, "activation_offload", False)),
        activation_compression=pick(args.activation_compression, "activation_compression", None),
        precision=args.precision or str(strategy.get("_precision") or "bf16-mixed"),
        micro_batch_size=args.micro_batch_size,
        sequence_length=args.sequence_length or 2048,
        optimizer=args.optimizer,
        compile=bool(strategy.get("compile", False)),
    )


def run_planner(
    args: argparse.Namespace, model: nn.Module, layout: Layout
) -> tuple[list[str], dict[str, Any]]:
    """Text lines and the JSON object of the plan's memory and time (or of the search)."""
    shape = describe(model)
    cluster: Cluster | None = load_cluster(args.cluster) if args.cluster else None
    if args.search:
        if not args.gpus or not args.global_batch or cluster is None:
            raise ValueError(
                "`--search` needs `--gpus N`, `--global-batch B` and `--cluster NAME` (or a YAML file)."
            )
        result = search(
            model,
            args.gpus,
            cluster,
            args.global_batch,
            layout.sequence_length,
            layout.precision,
            top=args.top,
            shape=shape,
        )
        confidence = expected_error(cluster.name, layout.precision)
        return [*search_lines(result, args.gpus, cluster), confidence], {
            **search_json(result),
            "expected_error": confidence,
        }
    problems = layout_problems(layout, shape)
    if problems:
        raise ValueError(
            f"The layout {layout.short()} cannot exist for {shape.name}: " + "; ".join(problems) + "."
        )
    ranks = rank_memory(model, layout, shape)
    lines = memory_lines(layout, ranks, cluster)
    time = step_time(shape, layout, cluster) if cluster is not None else None
    if time is not None and cluster is not None:
        lines += time_lines(time, cluster)
    if args.png:
        lines.append(f"picture: {render_plan(args.png, layout, ranks, time, cluster)}")
    return lines, plan_json(layout, ranks, time, cluster)


def _policy(value: object) -> str:
    """A strategy's ``activation_checkpointing_policy`` as the planner models it: the op policies by name;
    None (and block-level policies, which the planner does not tell apart) as ``"ops"``."""
    return value if value in ("ops", "ops_alternate_matmuls") else "ops"  # type: ignore[return-value]
