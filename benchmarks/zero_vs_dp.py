"""ZeRO 1/2/3 (and ZeRO-2/3 under two pipeline stages, FSDP2 per stage) against plain data parallelism, on CPU ranks.

    python -m benchmarks.zero_vs_dp                       # 2 CPU processes over gloo, the "small" shape
    python -m benchmarks.zero_vs_dp --shape tiny --rounds 2 --steps 10
    python -m benchmarks.zero_vs_dp --pipeline            # 4 processes: zero2/3 x pp2 (FSDP2) against pp2
    python -m benchmarks.zero_vs_dp --offload             # 2 processes: ZeRO-2 offload to CPU / NVMe / half of it

The recipe GPT, same initial weights and batches, AdamW, fp32. In each rank every configuration
trains ``--steps`` timed steps (after ``--warmup``) in turn, in a different order each round
(alternating, so a slow stretch of the machine hits all alike); a callback times each step
(forward, backward, optimizer). Printed: the median step time of each configuration and its ratio
to the reference (``dp``: ``HybridParallelStrategy()``; with ``--pipeline``: ``pp2``), each
round's ratios. Lightning's own ``FSDPStrategy`` ("requires a GPU accelerator") and
``DeepSpeedStrategy`` ("only supported on CUDA GPUs") refuse the CPU accelerator, so they are
reported as not run; the GPU check compares against them where a GPU is lent. On 2 cores the ZeRO stages mostly measure their extra collectives and
DeepSpeed's bookkeeping, not memory: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    StepTimer,
    finish_worker,
    init_process_group,
    launch,
    launch_env,
    machine,
    quiet_lightning,
    recipe_data,
    recipe_model,
    table,
)

SHAPES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8),
    "small": dict(n_layer=4, n_head=4, n_embd=256, block_size=128, batch_size=8),
}
DATA_PARALLEL = {"dp": {}, "zero1": {"zero_stage": 1}, "zero2": {"zero_stage": 2}, "zero3": {"zero_stage": 3}}
PIPELINED = {"pp2": {}, "zero2_pp2": {"zero_stage": 2}, "zero3_pp2": {"zero_stage": 3}}
# ZeRO-2 offloaded: DeepSpeed's CPU offload, the FSDP2 engine's NVMe (Adam's states in files of a temporary
# folder, on whatever disk holds it) and partial offload (half the units' optimizers kept on the device).
NVME = str(Path(tempfile.gettempdir()) / "lp-bench-nvme")
OFFLOADED = {
    "zero2": {"zero_stage": 2}, "zero2_cpu": {"zero_stage": 2, "offload": "cpu"},
    "zero2_cpu_half": {"zero_stage": 2, "offload": "cpu", "offload_ratio": 0.5},
    "zero2_nvme": {"zero_stage": 2, "offload": "nvme", "offload_path": NVME},
    "zero2_nvme_half": {"zero_stage": 2, "offload": "nvme", "offload_path": NVME, "offload_ratio": 0.5},
}  # fmt: skip


def _fit(
    name: str, kwargs: dict[str, Any], shape: dict[str, Any], data: Any, args: argparse.Namespace
) -> list[float]:
    import lightning as L

    from lightning_parallel import HybridParallelStrategy

    model = recipe_model(seed=1234, **{k: v for k, v in shape.items() if k != "batch_size"})
    pipeline = {"pipeline_parallel": 2, "micro_batches": 2} if args.pipeline else {}
    strategy = HybridParallelStrategy(timeout=120, **pipeline, **kwargs)
    timer = StepTimer(warmup=args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.nprocs, strategy=strategy, max_steps=args.steps + args.warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(model, datamodule=recipe_data(shape["block_size"], shape["batch_size"], like=data))
    return list(timer.times)


def worker(args: argparse.Namespace) -> None:

    quiet_lightning()
    torch.set_num_threads(1)
    dist_env = launch_env()
    rank = init_process_group()
    shape = SHAPES[args.shape]
    data = recipe_data(shape["block_size"], shape["batch_size"])
    data.setup("fit")
    configs = PIPELINED if args.pipeline else OFFLOADED if args.offload else DATA_PARALLEL
    rounds: list[dict[str, list[float]]] = []
    for index in range(args.rounds):
        order = list(configs) if index % 2 == 0 else list(configs)[::-1]
        measured = {}
        for name in order:
            os.environ.update(dist_env)  # Lightning's environment deletes WORLD_SIZE at teardown
            measured[name] = _fit(name, configs[name], shape, data, args)
        rounds.append(measured)
    if rank == 0:
        (args.out / "zero_vs_dp.json").write_text(json.dumps(rounds))
    finish_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pipeline", action="store_true", help="4 ranks: ZeRO-2/3 x pp2 against pp2")
    parser.add_argument("--offload", action="store_true", help="2 ranks: ZeRO-2 offload to CPU, NVMe, half")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nprocs", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    nprocs = 4 if args.pipeline else 2
    forwarded = [
        "--worker",
        "--shape",
        args.shape,
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--nprocs",
        str(nprocs),
    ] + (["--pipeline"] if args.pipeline else [])
    forwarded += ["--offload"] if args.offload else []  # fmt: skip
    start = time.perf_counter()
    out = launch("benchmarks.zero_vs_dp", forwarded, nprocs=nprocs, timeout_s=3600)
    rounds = json.loads((out / "zero_vs_dp.json").read_text())
    reference = "pp2" if args.pipeline else "zero2" if args.offload else "dp"
    medians = {name: statistics.median([t for r in rounds for t in r[name]]) for name in rounds[0]}
    rows = []
    for name, median in medians.items():
        per_round = [statistics.median(r[name]) / statistics.median(r[reference]) for r in rounds]
        rows.append([name, f"{median * 1e3:.1f} ms", f"{median / medians[reference]:.2f}x",
                     ", ".join(f"{x:.2f}" for x in per_round)])  # fmt: skip
    print(f"# {machine()}; recipe GPT {SHAPES[args.shape]}; {nprocs} CPU ranks, {len(rounds)} rounds,"
          f" {time.perf_counter() - start:.0f} s")  # fmt: skip
    print(table(["configuration", "median step", f"vs {reference}", "per round"], rows))
    if not (args.pipeline or args.offload):
        print("Lightning's FSDPStrategy and DeepSpeedStrategy: not run, both refuse the CPU accelerator")


if __name__ == "__main__":
    main()
