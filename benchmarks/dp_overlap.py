"""The data-parallel reduction of sharded-expert layouts: overlapped with the last backward, against after it.

    python -m benchmarks.dp_overlap                   # 2 CPU processes over gloo, MoE recipe, ep=2 (dp=2)
    python -m benchmarks.dp_overlap --shape medium --steps 20

With ``expert_parallel`` (and under pipeline stages) DDP's reducer cannot express the reductions,
so the strategy runs its own bucketed all-reduces (``data_parallel/buckets.py``): each bucket is
launched from backward as soon as its gradients are final. The comparison switches that off on one
of two otherwise identical runs (``GradientSync.begin_final`` made a no-op on that run's instance:
every bucket then launches after backward, as before) and times both side by side: one launch,
both ``Trainer``s of a rank in threads with their steps interleaved one by one
(``common.run_lockstep``), rounds alternating which steps first; same MoE recipe, same weights,
same batches. Printed: median step times and the paired ratio overlapped / after (target <= 1.0).

On this project's 2-core CPU machine both ranks' compute and gloo's communication threads share
two cores, so the overlap can buy little here; the benchmark shows the overlap costs nothing
where it cannot help, and measures what it buys where communication has its own hardware.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Baton,
    LockstepTimer,
    Timings,
    breakdown,
    compare,
    finish_worker,
    init_process_group,
    launch,
    launch_env,
    machine,
    print_comparison,
    quiet_lightning,
    recipe_data,
    run_paired_rounds,
)

SHAPES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8, num_experts=4),
    "small": dict(n_layer=4, n_head=4, n_embd=256, block_size=128, batch_size=8, num_experts=4),
    "medium": dict(n_layer=6, n_head=8, n_embd=384, block_size=128, batch_size=8, num_experts=4),
}
CONFIGS = ("after", "overlapped")


def _after_backward() -> Any:
    """A callback: this run's buckets all launch after backward (the overlap switched off on its instance)."""
    import lightning as L

    class AfterBackward(L.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            sync = trainer.strategy.parallelized.gradients.after_backward
            sync.begin_final = lambda params=None: None

    return AfterBackward()


def _fit(config: str, shape: dict[str, Any], data: Any, args: argparse.Namespace, timer: Any) -> None:
    import lightning as L

    from lightning_parallel import HybridParallelStrategy
    from recipes.moe.module import MoEGPTLightningModule

    torch.manual_seed(1234)
    model = MoEGPTLightningModule(warmup_steps=1, lr_decay_steps=1000, capacity_factor=None,
                                  **{k: v for k, v in shape.items() if k != "batch_size"})  # fmt: skip
    callbacks = [timer] + ([_after_backward()] if config == "after" else [])
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(expert_parallel=2, timeout=120),
        max_steps=args.steps + args.warmup, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, datamodule=recipe_data(shape["block_size"], shape["batch_size"], like=data))


def worker(args: argparse.Namespace) -> None:
    quiet_lightning()
    torch.set_num_threads(args.threads)
    dist_env = launch_env()
    rank = init_process_group()
    shape = SHAPES[args.shape]
    data = recipe_data(shape["block_size"], shape["batch_size"])
    data.setup("fit")

    def run(baton: Baton, name: str) -> Timings:
        timer = LockstepTimer(baton, name, warmup=args.warmup)
        _fit(name, shape, data, args, timer)
        return timer.result()

    run_paired_rounds(CONFIGS, run, args.rounds, dist_env, rank, args.out / "dp_overlap.json")
    finish_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs both configurations")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    forwarded = ["--worker", "--shape", args.shape, "--rounds", str(args.rounds), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--threads", str(args.threads)]  # fmt: skip
    out = launch("benchmarks.dp_overlap", forwarded, nprocs=2, timeout_s=3600, threads=args.threads)
    result = json.loads((out / "dp_overlap.json").read_text())
    c = compare(result["rounds"], "after", "overlapped")
    shape = SHAPES[args.shape]
    print(f"per-round ratios overlapped / after: {', '.join(f'{r:.3f}' for r in c['per_round'])}")
    print(
        f"\n# {machine()}, 2 ranks x {result['threads']} torch threads, gloo, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"# MoE recipe {shape} (batch per rank), expert_parallel=2; {args.rounds} rounds x {args.steps} timed"
          f" steps (+{args.warmup} warm-up) per configuration, steps interleaved; {result['seconds']:.0f} s\n")  # fmt: skip
    print_comparison(c, ("buckets all-reduced after backward", "buckets launched during the last backward"),
                     "overlapped / after", 1.0)  # fmt: skip
    print(
        "parts of the step (medians; paired ratios):\n" + breakdown(result["rounds"], "after", "overlapped")
    )


if __name__ == "__main__":
    main()
