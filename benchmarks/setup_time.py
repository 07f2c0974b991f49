"""Setup time of the GPT recipe's main layout (tp=2 with sequence parallelism, 2 CPU processes).

    python -m benchmarks.setup_time                  # 3 runs of the main job's layout, 1 step each
    python -m benchmarks.setup_time --runs 5 --pipeline 2

Each run is a fresh ``python -m recipes.gpt.hybrid``-like job (2 processes, the recipe's
config) that stops after one training step. Rank 0 prints two times: ``strategy.setup`` (plan,
verification, sharding, optimizers: what the strategy adds) and ``fit -> first step`` (the
whole wait before training, Lightning's own set-up included). Printed: each run and the median
of each. Use it to compare two versions of the library on the same machine, run after run
(``git worktree`` one of them): the numbers are seconds, not a ratio, and the machine's load
moves them, so alternate the two versions and compare medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L

from lightning_parallel import HybridParallelStrategy

MARK = "SETUP_TIME_JSON "


class TimedStrategy(HybridParallelStrategy):
    """The strategy, with its ``setup`` timed (rank 0 prints the result at the first step)."""

    setup_seconds: float = 0.0

    def setup(self, trainer: L.Trainer) -> None:
        start = time.perf_counter()
        super().setup(trainer)
        self.setup_seconds = time.perf_counter() - start


class FirstStep(L.Callback):
    """Stops the fit at the first training batch and prints the times (rank 0)."""

    def __init__(self) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int
    ) -> None:
        if trainer.global_rank == 0:
            strategy = trainer.strategy
            result = {
                "setup_s": getattr(strategy, "setup_seconds", float("nan")),
                "fit_to_first_step_s": time.perf_counter() - self.fit_start,
            }
            print(MARK + json.dumps(result), flush=True)
        trainer.should_stop = True


def _job(pipeline: int) -> None:
    """One job (this process and the rank Lightning launches beside it)."""
    import torch

    from recipes.gpt.data import TokenDataModule
    from recipes.gpt.module import GPTLightningModule

    torch.set_num_threads(1)
    L.seed_everything(1337, verbose=False)
    callback = FirstStep()
    model = GPTLightningModule(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_embd=64, bias=True)
    data = TokenDataModule(batch_size=16, block_size=64, num_workers=0)
    layout = {"pipeline_parallel": 2} if pipeline > 1 else {"tensor_parallel": 2, "sequence_parallel": True}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TimedStrategy(**layout),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback],
    )
    trainer.fit(model, data)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pipeline", type=int, default=1, help="2: time pp=2 instead of tp=2 + sp")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(args.pipeline)
        return
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    results = []
    for run in range(args.runs):
        cmd = [sys.executable, "-m", "benchmarks.setup_time", "--job", "--pipeline", str(args.pipeline)]
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=True).stdout
        line = next(line for line in out.splitlines() if line.startswith(MARK))
        result = json.loads(line[len(MARK) :])
        results.append(result)
        print(
            f"run {run}: strategy.setup {result['setup_s']:.2f} s, fit -> first step {result['fit_to_first_step_s']:.2f} s"
        )
    for key, label in (("setup_s", "strategy.setup"), ("fit_to_first_step_s", "fit -> first step")):
        print(f"median {label}: {statistics.median(r[key] for r in results):.2f} s")


if __name__ == "__main__":
    main()
