"""``python -m lightning_parallel plan``: print the plan for a model before paying for the job.

    python -m lightning_parallel plan --model recipes.gpt.module.GPTLightningModule \\
        --init '{"n_layer": 2}' --tensor-parallel 2 --sequence-parallel
    python -m lightning_parallel plan --config recipes/gpt/configs/tiny.yaml \\
        --model recipes.gpt.module.GPTLightningModule --tensor-parallel 2

The model class is imported by its dotted path and built on the CPU with the given keyword
arguments (from ``--init`` JSON, or from the ``model:`` section of a LightningCLI YAML file:
``class_path``/``init_args``, or plain arguments when the CLI fixes the class). No process
group is created: the bytes per rank are computed from the plan's styles arithmetically
(a sharded dimension is split ``tensor_parallel`` ways, the largest shard is reported), so
this runs on a laptop for a model that will train on 512 GPUs, as long as it fits in memory.
What it cannot do without the ranks is the numerical check of each block: that happens at
``Trainer.fit`` setup (``docs/plans.md``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_parallel  # noqa: F401  (registers the strategy names)
from lightning_parallel.checkpoint.transfer import add_export_command, run_export
from lightning_parallel.config.arguments import pipeline
from lightning_parallel.pipeline.setup import split_stages
from lightning_parallel.planner.command import add_planner_arguments, layout_from_arguments, run_planner
from lightning_parallel.planner.report import dumps
from lightning_parallel.plans import ParallelPlan, auto_plan, plan_from_dict
from lightning_parallel.strategy import HybridParallelStrategy
from lightning_parallel.tensor_parallel.styles import sharded_dims

__all__ = ["build_parser", "main", "parameter_shards"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- bytes per rank without a process group ----------------------------------------------------


def _local_numel(shape: torch.Size, dim: int | None, tp: int, num_chunks: int) -> int:
    """Elements of the largest shard (DTensor splits like ``torch.chunk``: rank 0 gets the most)."""
    if dim is None:
        return math.prod(shape)
    size = shape[dim]
    local = num_chunks * math.ceil(size / num_chunks / tp) if size % num_chunks == 0 else math.ceil(size / tp)
    return math.prod(shape) // size * min(local, size)


def parameter_shards(plan: ParallelPlan, model: nn.Module, dtype: torch.dtype | None = None) -> dict:
    """``{parameter name: (global numel, local numel on the largest rank, bytes per element)}``.

    The same table ``record_parameter_shards`` fills from the sharded model, computed from
    the unsharded model and the plan. Tied parameters appear once, under their first name.
    """
    shards: dict[str, tuple[int, int, int]] = {}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        style = plan.styles.get(owner)
        dim = sharded_dims(modules[owner], style).get(attr) if style is not None else None
        chunks = getattr(style, "num_chunks", 1)
        element_size = torch.empty((), dtype=dtype or param.dtype).element_size()
        shards[name] = (
            param.numel(),
            _local_numel(param.shape, dim, plan.tensor_parallel, chunks),
            element_size,
        )
    return shards


# ---- building the model ----------------------------------------------------------------------


def import_object(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"`--model {dotted}` must be a dotted path such as `package.module.ClassName`.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"`--model {dotted}`: cannot import {attr!r} from {module_name!r} ({error})."
        ) from None


def _strategy_settings(strategy: Any) -> dict[str, Any]:
    """Tensor/sequence-parallel settings of a LightningCLI ``trainer.strategy`` entry, if it names ours."""
    if isinstance(strategy, str):
        # the entry, not .get()'s instance
        entry = StrategyRegistry[strategy] if strategy in StrategyRegistry else None
        if entry is None or entry["strategy"] is not HybridParallelStrategy:
            return {}
        return dict(entry["init_params"])
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("HybridParallelStrategy"):
        return dict(strategy.get("init_args") or {})
    return {}


def read_config(path: str) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """(model class path or None, model init args, strategy settings) from a LightningCLI YAML file."""

    config = yaml.safe_load(Path(path).read_text()) or {}
    model = config.get("model") or {}
    if not isinstance(model, dict):
        raise ValueError(
            f"`--config {path}`: the `model:` section must be a mapping, got {type(model).__name__}."
        )
    trainer = config.get("trainer") or {}
    strategy = _strategy_settings(trainer.get("strategy"))
    for key in ("devices", "num_nodes", "precision"):  # what the planner needs of the Trainer (underscored)
        if key in trainer:
            strategy[f"_{key}"] = trainer[key]
    if "class_path" in model:
        return model["class_path"], dict(model.get("init_args") or {}), strategy
    return None, model, strategy


def build_model(class_path: str, init_args: dict[str, Any]) -> nn.Module:
    """The model on the meta device (shapes without memory: a 405B model plans on a laptop); on the CPU
    when its constructor needs real tensors."""
    cls = import_object(class_path)
    try:
        with torch.device("meta"):
            model = cls(**init_args)
    except (RuntimeError, NotImplementedError):
        with torch.device("cpu"):
            model = cls(**init_args)
    if not isinstance(model, nn.Module):
        raise ValueError(f"`--model {class_path}` built a {type(model).__name__}, not a torch.nn.Module.")
    return model


# ---- the command -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser(
        "plan", help="print the tensor/sequence-parallel plan and the parameter bytes per rank"
    )
    plan.add_argument("--model", help="dotted path of the LightningModule or nn.Module class")
    plan.add_argument("--init", default="{}", help="JSON object of keyword arguments for the class")
    plan.add_argument(
        "--config", help="LightningCLI YAML file: `model:` (class_path/init_args) and trainer.strategy"
    )
    plan.add_argument("--tensor-parallel", type=int, default=None, help="tensor-parallel degree (default 2)")
    plan.add_argument(
        "--sequence-parallel", action="store_true", default=None, help="also shard along the sequence"
    )
    plan.add_argument(
        "--plan", dest="plan_dict", help='JSON dict {"module pattern": "style name"} instead of auto'
    )
    plan.add_argument(
        "--dtype", choices=sorted(DTYPES), help="parameter dtype for the bytes (default: as built)"
    )
    plan.add_argument(
        "--pipeline-parallel", type=int, default=None, help="pipeline stages: print which blocks each holds"
    )
    plan.add_argument("--pipeline-schedule", default=None, help="pipeline schedule name (default 1f1b)")
    plan.add_argument(
        "--pipeline-virtual-stages", type=int, default=None, help="stages per rank (interleaved)"
    )
    add_planner_arguments(plan)
    add_export_command(commands)  # checkpoint -> one safetensors file (checkpoint/transfer.py)
    return parser


def pipeline_lines(model: nn.Module, pp: int, schedule: str | None, virtual: int | None) -> list[str]:
    """Which blocks each pipeline stage will hold: the split the strategy makes at setup (``split_stages``)."""
    config = pipeline(pp, None, schedule, virtual, None)
    assert config is not None
    split = split_stages(model, config)
    lines = [f"  pipeline: {pp} ranks, {config.num_stages} stages, schedule {config.spec.name!r}"]
    for stage, blocks in enumerate(split.ranges):
        params = sum(split.block_costs[i] for i in blocks)
        names = split.block_names
        lines.append(
            f"    stage {stage} (rank {split.owners[stage]}): {names[blocks.start]}..{names[blocks.stop - 1]}"
            f" ({len(blocks)} blocks, {params:,} parameters)"
        )
    lines.append("    + weights before the first block on stage 0, after the last block on the last stage")
    return lines


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"`{flag}` is not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"`{flag}` must be a JSON object ({{...}}), got {text!r}.")
    return value


def run_plan(args: argparse.Namespace) -> str:
    class_path, init_args, strategy = args.model, {}, {}
    if args.config:
        config_class, init_args, strategy = read_config(args.config)
        class_path = class_path or config_class
    if not class_path:
        raise ValueError(
            "Give the model class with `--model package.module.Class` (or `model.class_path` in --config)."
        )
    init_args.update(_json_object(args.init, "--init"))
    tp = args.tensor_parallel or strategy.get("tensor_parallel") or 2
    if args.search and not isinstance(tp, int):
        tp = 1  # the search chooses the degree; "auto" in the config means nothing here
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"`--tensor-parallel {tp}` must be a positive integer ('auto' needs the devices).")
    sp = bool(
        args.sequence_parallel if args.sequence_parallel is not None else strategy.get("sequence_parallel")
    )
    sp = sp and tp > 1

    model = build_model(class_path, init_args)
    layout = layout_from_arguments(args, strategy, tp, sp=sp)
    if args.search:
        planner_lines, planner_json = run_planner(args, model, layout)
        return dumps(planner_json) if args.json else "\n".join(planner_lines)
    patterns = _json_object(args.plan_dict, "--plan") if args.plan_dict else strategy.get("plan")
    plan = (
        plan_from_dict(model, patterns, tp, sequence_parallel=sp)
        if isinstance(patterns, dict)
        else auto_plan(model, tp, sequence_parallel=sp)
    )
    plan.parameter_shards = parameter_shards(plan, model, DTYPES.get(args.dtype) if args.dtype else None)

    num_params = sum(g for g, _, _ in plan.parameter_shards.values())
    largest = sorted(plan.parameter_shards.items(), key=lambda kv: -kv[1][1] * kv[1][2])[:5]
    lines = [
        f"model: {class_path} ({num_params:,} parameters)",
        str(plan),
        "  largest parameters on one rank:",
        *(
            f"    {name}: {loc:,} of {glob:,} elements, {loc * size:,} B"
            for name, (glob, loc, size) in largest
        ),
        "  computed without processes; each block is verified sharded vs unsharded at Trainer.fit setup.",
    ]
    pp = args.pipeline_parallel or strategy.get("pipeline_parallel") or 1
    if pp > 1:
        lines += pipeline_lines(
            model,
            pp,
            args.pipeline_schedule or strategy.get("pipeline_schedule"),
            args.pipeline_virtual_stages or strategy.get("pipeline_virtual_stages"),
        )
    planner_lines, planner_json = run_planner(args, model, layout)
    return dumps(planner_json) if args.json else "\n".join(lines + planner_lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            print(run_plan(args))
        elif args.command == "export":
            print(run_export(args))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
