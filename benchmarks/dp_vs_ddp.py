"""Data parallelism: ``HybridParallelStrategy()`` on 2 devices (FSDP2 ``replicate``) against ``strategy="ddp"``.

    python -m benchmarks.dp_vs_ddp                    # 2 CPU processes over gloo, the "small" shape
    python -m benchmarks.dp_vs_ddp --shape medium --steps 30
    python -m benchmarks.dp_vs_ddp --collectives      # instead: the gradient collectives of one step of each

The script starts its 2 ranks itself (``common.launch``: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT set), so Lightning launches nothing and every ``Trainer`` of a rank
reuses the one gloo process group the rank opened. In each rank both configurations run in
ONE launch, each ``Trainer`` in its own thread, their training steps interleaved one by one
(``common.run_lockstep``: only one thread runs at a time, in the same order on both ranks, so
their collectives never mix). Same recipe GPT, same initial weights, same batches (Lightning's
``DistributedSampler`` with the same seed in both). Rounds alternate which configuration steps
first. Printed (from rank 0's times): the median step times and the ratio strategy / DDP
(target <= 1.0), the median of the paired ratios of back-to-back steps.
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
    recipe_model,
    run_paired_rounds,
)

SHAPES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8),
    "small": dict(n_layer=4, n_head=4, n_embd=256, block_size=128, batch_size=8),  # 3.3M parameters
    "medium": dict(n_layer=6, n_head=8, n_embd=512, block_size=128, batch_size=8),  # 19M parameters
}
CONFIGS = ("ddp", "strategy")


def _fit(config: str, shape: dict[str, Any], data: Any, args: argparse.Namespace, timer: Any) -> None:
    import lightning as L

    from lightning_parallel import HybridParallelStrategy

    model = recipe_model(seed=1234, **{k: v for k, v in shape.items() if k != "batch_size"})
    strategy = HybridParallelStrategy(timeout=120) if config == "strategy" else "ddp"
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps + args.warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(model, datamodule=recipe_data(shape["block_size"], shape["batch_size"], like=data))


def _collectives(
    shape: dict[str, Any], data: Any, args: argparse.Namespace, dist_env: dict[str, str]
) -> dict:
    """The collectives of one training step (the third) of each configuration, on this rank."""
    from benchmarks.tp_collectives import CollectiveCounter

    counts = {}
    for name in CONFIGS:
        os.environ.update(dist_env)
        counter = CollectiveCounter(step=2)
        args.steps, args.warmup = 3, 0
        _fit(name, shape, data, args, counter)
        start, end = counter.marks["backward"], counter.marks["optimizer"]
        counts[name] = [f"{e.phase} {e.kind} of {e.elements:,} elements, issued at"
                        f" {100 * (e.time_s - start) / (end - start):.0f}% of the backward" for e in counter.events]  # fmt: skip
    return counts


def worker(args: argparse.Namespace) -> None:

    quiet_lightning()
    torch.set_num_threads(args.threads)
    dist_env = launch_env()
    rank = init_process_group()
    shape = SHAPES[args.shape]
    data = recipe_data(shape["block_size"], shape["batch_size"])
    data.setup("fit")
    if args.collectives:
        counts = _collectives(shape, data, args, dist_env)
        if rank == 0:
            (args.out / "collectives.json").write_text(json.dumps(counts))
        finish_worker()

    def run(baton: Baton, name: str) -> Timings:
        timer = LockstepTimer(baton, name, warmup=args.warmup)
        _fit(name, shape, data, args, timer)
        return timer.result()

    run_paired_rounds(CONFIGS, run, args.rounds, dist_env, rank, args.out / "dp_vs_ddp.json")
    finish_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs both configurations")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--collectives", action="store_true", help="list each one's collectives of one step instead"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    forwarded = ["--worker", "--shape", args.shape, "--rounds", str(args.rounds), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--threads", str(args.threads)]  # fmt: skip
    if args.collectives:
        out = launch("benchmarks.dp_vs_ddp", [*forwarded, "--collectives"], nprocs=2, timeout_s=600)
        print(f"# {machine()}; recipe GPT {SHAPES[args.shape]}; one training step on rank 0")
        for name, events in json.loads((out / "collectives.json").read_text()).items():
            print(f"\n{name}: {len(events)} collectives")
            print("\n".join(f"  {line}" for line in events))
        return
    out = launch("benchmarks.dp_vs_ddp", forwarded, nprocs=2, timeout_s=3600, threads=args.threads)
    result = json.loads((out / "dp_vs_ddp.json").read_text())
    c = compare(result["rounds"], "ddp", "strategy")
    shape = SHAPES[args.shape]
    print(f"per-round ratios strategy / ddp: {', '.join(f'{r:.3f}' for r in c['per_round'])}")
    print(
        f"\n# {machine()}, 2 ranks x {result['threads']} torch threads, gloo, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"# recipe GPT {shape} (batch per rank); {args.rounds} rounds x {args.steps} timed steps"
          f" (+{args.warmup} warm-up) per configuration, steps interleaved; {result['seconds']:.0f} s\n")  # fmt: skip
    print_comparison(c, ("Trainer(strategy='ddp'), devices=2", "Trainer(strategy=HybridParallelStrategy()), devices=2"),
                     "strategy / ddp", 1.0)  # fmt: skip
    print("parts of the step (medians; paired ratios):\n" + breakdown(result["rounds"], "ddp", "strategy"))


if __name__ == "__main__":
    main()
