"""One GPU, bf16-mixed: every ZeRO engine against plain PyTorch eager on the same model and batches.

    PYTHONPATH=. python -m benchmarks.zero_engines --group deepspeed      # eager, strategy, DeepSpeed ZeRO-1/2/3
    PYTHONPATH=. python -m benchmarks.zero_engines --group fsdp2          # eager, FSDP2 ZeRO-2/3, ZeRO-3 bf16 gathers
    PYTHONPATH=. python -m benchmarks.zero_engines --group offload        # eager, ZeRO-2 + CPU offload, ZeRO-3 + params
    PYTHONPATH=. python -m benchmarks.zero_engines --group deepspeed --tiny --cpu   # the same paths on a CPU

The recipe's GPT (GPT-3 XL shape: 1.3B parameters, batch 8 x 2048, its AdamW and schedule), in ONE
process per group: plain PyTorch eager first (``benchmarks/gpu_step.py``'s loop: ``torch.autocast``,
backward, step), then each engine through ``Trainer(precision="bf16-mixed",
strategy=HybridParallelStrategy(...))``. Every figure is against eager, never one of our paths
against another: a regression that all our engines share (the fp32 forward of 2026-12-04, 9.8x
eager) shows in every row.

Per engine: median step time and its ratio to eager (target: at most 1.05x without offload, 2x with
CPU offload; DeepSpeed's own ZeRO-2 + CPU Adam measured 3.2x on that machine, FSDP2's
``CPUOffloadPolicy`` 7.6x); peak device memory against the planner's prediction for the layout
(``lightning_parallel.planner.rank_memory``, the ``zero_engine`` given; target within 10%); the
compute dtype seen: the share of ``nn.Linear`` outputs in bf16 during one training step (must be 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.common import StepTimer, machine, quiet_lightning, table
from benchmarks.gpu_step import LARGE, TINY, _batches, _held_gib, _module, _peak_gib, _reset_memory, run_plain
from lightning_parallel.zero.arguments import ImportanceSplit

ON_DEVICE_TARGET = 1.05
OFFLOAD_TARGET = 2.0
MEMORY_TOLERANCE = 0.10

# name -> the strategy's arguments. "strategy" is every degree 1 (no ZeRO): the cost of the strategy alone.
GROUPS: dict[str, dict[str, dict[str, Any]]] = {
    "deepspeed": {
        "strategy": {},
        "deepspeed zero1": {"zero_stage": 1},
        "deepspeed zero2": {"zero_stage": 2},
        "deepspeed zero3": {"zero_stage": 3},
    },
    "fsdp2": {
        "fsdp2 zero2": {"zero_stage": 2, "zero_engine": "fsdp2"},
        "fsdp2 zero3": {"zero_stage": 3, "zero_engine": "fsdp2"},
        # The shards cast to bf16 before the all-gather (FSDP2's MixedPrecisionPolicy, as torchtitan): issue 33 asks
        # whether it should be the default; on one GPU the gather is a copy, the cast per matmul is what changes.
        "fsdp2 zero3, bf16 gathers": {"zero_stage": 3, "zero_engine": "fsdp2", "zero_gather_dtype": "compute"},
    },
    "offload": {
        "zero2 + cpu offload": {"zero_stage": 2, "offload": "cpu"},
        # The host step of each shard during backward (zero/overlapped_step.py, issue 35): FSDP2's engine.
        "fsdp2 zero2 + cpu offload (host step in backward)": {
            "zero_stage": 2,
            "offload": "cpu",
            "zero_engine": "fsdp2",
        },
        # Step i's host step during step i+1 (ZeRO-Offload's delayed parameter update): not exact, off by default.
        "zero2 + cpu offload, delayed update": {
            "zero_stage": 2,
            "offload": "cpu",
            "offload_update": "delayed",
        },
        "zero3 + cpu offload (parameters too)": {"zero_stage": 3, "offload": "cpu"},
        # Last, where the phase's time limit cuts first: the rows with the largest gradients at once, the rest every
        # 4 steps behind the next step (ZenFlow's idea, zero/importance_split.py): not exact, off by default.
        "zero2 + cpu offload, importance split": {
            "zero_stage": 2,
            "offload": "cpu",
            "offload_update": ImportanceSplit(top_rows=0.05, update_interval=4),
        },
    },
}


def target_for(name: str) -> float:
    return OFFLOAD_TARGET if "offload" in name else ON_DEVICE_TARGET


def ComputeDtypes() -> Any:  # noqa: N802 (a factory: Lightning is imported lazily)
    """A callback counting the dtypes of every ``nn.Linear`` output during the second training step."""
    from lightning.pytorch.callbacks import Callback

    class _ComputeDtypes(Callback):
        def __init__(self) -> None:
            self.counts: dict[str, int] = {}
            self._handles: list[Any] = []

        def _count(self, module: Any, inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                key = str(output.dtype).removeprefix("torch.")
                self.counts[key] = self.counts.get(key, 0) + 1

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                linears = [m for m in pl_module.modules() if isinstance(m, torch.nn.Linear)]
                self._handles = [m.register_forward_hook(self._count) for m in linears]

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    return _ComputeDtypes()


def run_strategy(
    shape: dict[str, Any], batches: list, device: torch.device, steps: int, warmup: int, **strategy: Any
) -> dict[str, Any]:
    """The recipe module through ``Trainer.fit`` under ``HybridParallelStrategy(**strategy)``, bf16-mixed."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_parallel import HybridParallelStrategy

    _reset_memory(device)
    module = _module(shape, device)
    timer, dtypes = StepTimer(warmup=warmup), ComputeDtypes()
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision="bf16-mixed", max_steps=warmup + steps,
        strategy=HybridParallelStrategy(timeout=600, **strategy), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False, callbacks=[timer, dtypes],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, shuffle=False))
    host_step = getattr(trainer.strategy, "host_step", None)  # the host steps run during backward (issue 35)
    result = {"times": timer.times, "peak_gib": _peak_gib(device), "dtypes": dtypes.counts,
              "host_steps_in_backward": host_step.stepped_in_backward if host_step is not None else 0}  # fmt: skip
    del trainer, module
    return result


def predicted_gib(shape: dict[str, Any], strategy: dict[str, Any]) -> float:
    """The planner's device bytes for this layout (states, activations, buffers), in GiB."""
    from lightning_parallel.planner import Layout, describe, rank_memory
    from recipes.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**{k: v for k, v in shape.items() if k != "batch_size"}, dropout=0.0))
    layout = Layout(
        precision="bf16-mixed", micro_batch_size=shape["batch_size"], sequence_length=shape["block_size"],
        zero_stage=strategy.get("zero_stage", 0), offload=strategy.get("offload"),
        zero_engine=strategy.get("zero_engine", "auto"), offload_update=strategy.get("offload_update", "exact"),
        zero_gather_dtype=strategy.get("zero_gather_dtype", "stored"),
    )  # fmt: skip
    (rank,) = rank_memory(model, layout, describe(model))
    return rank.device_total / 2**30


def bf16_share(counts: dict[str, int]) -> float:
    total = sum(counts.values())
    return counts.get("bfloat16", 0) / total if total else 0.0


def run_group(
    group: str, shape: dict[str, Any], device: torch.device, steps: int, warmup: int
) -> dict[str, Any]:
    batches = _batches(shape, warmup + steps)
    results: dict[str, dict[str, Any]] = {"eager": run_plain(shape, batches, device, steps, warmup)}
    print(f"phase eager: median {statistics.median(results['eager']['times']) * 1e3:.1f} ms", flush=True)
    for name, strategy in GROUPS[group].items():
        began, held = time.perf_counter(), _held_gib(device)
        try:  # one engine failing must not cost the others' numbers
            results[name] = run_strategy(shape, batches, device, steps, warmup, **strategy)
        except Exception as error:  # noqa: BLE001
            results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            print(f"phase {name}: FAILED: {results[name]['error']}", flush=True)
            _reset_memory(device)
            continue
        results[name]["seconds"] = round(time.perf_counter() - began, 1)
        results[name]["held_gib"] = held  # what earlier phases left allocated (should be ~0)
        results[name]["predicted_gib"] = predicted_gib(shape, strategy)
        print(f"phase {name}: median {statistics.median(results[name]['times']) * 1e3:.1f} ms,"
              f" {results[name]['seconds']} s", flush=True)  # fmt: skip
    eager = statistics.median(results["eager"]["times"])
    rows, figures = [], {}
    for name, result in results.items():
        if "error" in result:
            rows.append([name, "FAILED", "", "", "", "", result["error"][:60]])
            continue
        step = statistics.median(result["times"])
        # What earlier phases left allocated counts in the peak: judge the phase's own memory (net of it).
        net = result["peak_gib"] - result.get("held_gib", 0.0)
        figures[name] = {"over_eager": step / eager, "target": target_for(name) if name != "eager" else None,
                         "peak_gib": net, "predicted_gib": result.get("predicted_gib"),
                         "bf16_share": bf16_share(result["dtypes"]) if "dtypes" in result else None}  # fmt: skip
        memory = f"{result['peak_gib'] / result['predicted_gib']:.2f}" if result.get("predicted_gib") else ""
        share = f"{figures[name]['bf16_share']:.2f}" if figures[name]["bf16_share"] is not None else ""
        rows.append([name, f"{step * 1e3:.1f} ms", f"{step / eager:.3f}x", f"{result['peak_gib']:.1f} GiB",
                     memory, share, ""])  # fmt: skip
    print(
        table(["phase", "step", "vs eager", "peak", "net peak / planner", "bf16 Linear share", "error"], rows)
    )
    for name, figure in figures.items():
        if figure["target"] is not None:
            verdict = "met" if figure["over_eager"] <= figure["target"] else "MISSED"
            print(
                f"RESULT {name} / eager = {figure['over_eager']:.3f} (target <= {figure['target']}: {verdict})"
            )
    return {"machine": machine(), "shape": shape, "steps": steps, "warmup": warmup, "results": results,
            "figures": figures}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", choices=sorted(GROUPS), required=True)
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the code paths in seconds")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per phase (default 6; tiny 3)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    quiet_lightning()
    if args.cpu:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        sys.exit("No GPU: pass --cpu (with --tiny) to check the code paths on the CPU.")
    shape = TINY if args.tiny else LARGE
    steps = args.steps or (3 if args.tiny else 6)
    print(
        f"# {machine()}\n# GPT {shape}, bf16-mixed, group {args.group}: {steps} timed steps (+{args.warmup})"
    )
    payload = run_group(args.group, shape, device, steps, args.warmup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    failed = [name for name, result in payload["results"].items() if "error" in result]
    if failed:
        sys.exit(f"Phases failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
