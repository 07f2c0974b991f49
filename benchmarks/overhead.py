"""Overhead of ``HybridParallelStrategy()`` (all degrees 1, one device) over Lightning's default.

    python -m benchmarks.overhead                      # CPU, the "small" shape, 6 rounds
    python -m benchmarks.overhead --shape tiny --rounds 10

Both configurations train the same recipe GPT (same initial weights) on the same batches
(the recipe's ``TokenDataModule``, no shuffling, no distributed sampler) in ONE process, each
``Trainer`` in its own thread, their steps interleaved one by one (``common.run_lockstep``:
A, B, A, B, ...; only one thread runs at a time), so that whatever else the machine does hits
both alike. A callback times each step (forward, backward, optimizer) from
``on_train_batch_start`` to ``on_train_batch_end``; the first ``--warmup`` steps of each run
are not timed. Each round is a fresh pair of Trainers and models; rounds alternate which
configuration steps first. Printed: the median step time of each configuration, and the
ratio strategy / default (target <= 1.02) as the median of the paired ratios of back-to-back
steps (robust to load that changes during the run), with its quartiles and per round.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from benchmarks.common import (
    Baton,
    LockstepTimer,
    Timings,
    breakdown,
    compare,
    machine,
    print_comparison,
    quiet_lightning,
    recipe_data,
    recipe_model,
    run_lockstep,
)

SHAPES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8),  # Python overhead dominates
    "small": dict(n_layer=4, n_head=4, n_embd=256, block_size=128, batch_size=8),
}


def _fit(
    config: str, shape: dict[str, Any], data: Any, steps: int, warmup: int, accelerator: str, timer: Any
) -> None:
    import lightning as L

    from lightning_parallel import HybridParallelStrategy

    model_kwargs = {k: v for k, v in shape.items() if k != "batch_size"}
    model = recipe_model(seed=1234, **model_kwargs)
    strategy = HybridParallelStrategy(timeout=120) if config == "strategy" else "auto"
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, max_steps=steps + warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(model, datamodule=recipe_data(shape["block_size"], shape["batch_size"], like=data))


def _round(
    order: tuple[str, ...], shape: dict[str, Any], data: Any, args: argparse.Namespace
) -> dict[str, Timings]:
    def run(baton: Baton, name: str) -> Timings:
        timer = LockstepTimer(baton, name, warmup=args.warmup)
        _fit(name, shape, data, args.steps, args.warmup, args.accelerator, timer)
        return timer.result()

    return run_lockstep({name: run for name in order})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs both configurations")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: all cores)")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    threads = args.threads or os.cpu_count() or 1
    # Lightning sets torch's threads to cores / processes when a strategy launches processes (even
    # one) unless OMP_NUM_THREADS is set: pin it, or the strategy's run changes both runs' threads.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    quiet_lightning()
    shape = SHAPES[args.shape]
    data = recipe_data(shape["block_size"], shape["batch_size"])  # one corpus load, shared by every run

    rounds = []
    start = time.perf_counter()
    for index in range(args.rounds):
        order = ("default", "strategy") if index % 2 == 0 else ("strategy", "default")
        rounds.append(_round(order, shape, data, args))
        c = compare(rounds[-1:], "default", "strategy")
        print(f"round {index} ({order[0]} first): default {c['reference_s'] * 1e3:.2f} ms, strategy"
              f" {c['candidate_s'] * 1e3:.2f} ms, paired ratio {c['ratio']:.3f}", flush=True)  # fmt: skip

    c = compare(rounds, "default", "strategy")
    print(f"\n# {machine()}, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    print(f"# recipe GPT {shape}; {args.rounds} rounds x {args.steps} timed steps (+{args.warmup} warm-up) per"
          f" configuration, steps interleaved; {time.perf_counter() - start:.0f} s\n")  # fmt: skip
    print_comparison(c, ("Trainer(strategy='auto'), devices=1", "Trainer(strategy=HybridParallelStrategy()), devices=1"),
                     "strategy / default", 1.02)  # fmt: skip
    print(f"per-round ratios: {', '.join(f'{r:.3f}' for r in c['per_round'])}")
    print("parts of the step (medians; paired ratios):\n" + breakdown(rounds, "default", "strategy"))


if __name__ == "__main__":
    main()
