"""Faults during a 2-rank run, for ``tests/strategy/test_faults.py``.

    python tests/strategy/scripts/faults.py kill-rank LAYOUT OUT_DIR   # rank 1 is SIGKILLed at batch 2
    python tests/strategy/scripts/faults.py corrupt-checkpoint OUT_DIR # a truncated shard, then resume

``kill-rank`` uses the strategy's default collective timeout (15 minutes): the job must end
because the dead peer's connections close, long before any timeout. Rank 1 writes the time of its
death to ``OUT_DIR/killed_at`` first.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import HybridParallelStrategy
from recipes.gpt.module import GPTLightningModule

MODEL = dict(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": dict(tensor_parallel=2),
    "pp2": dict(pipeline_parallel=2, micro_batches=2),
}


class KillRankOne(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, i: int) -> None:
        if i == 2 and trainer.global_rank == 1:
            (self.out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


def loader() -> DataLoader:
    tokens = torch.randint(
        MODEL["vocab_size"], (64, MODEL["block_size"] + 1), generator=torch.Generator().manual_seed(1)
    )
    return DataLoader(TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), batch_size=4)


def trainer(strategy: HybridParallelStrategy, max_steps: int, callbacks: list[L.Callback]) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )  # fmt: skip


def main(case: str, *args: str) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    if case == "kill-rank":
        layout, out = args[0], Path(args[1])
        trainer(HybridParallelStrategy(**LAYOUTS[layout]), 50, [KillRankOne(out)]).fit(
            GPTLightningModule(**MODEL), loader()
        )
        print("fit finished: the lost rank was NOT noticed", flush=True)
    elif case == "corrupt-checkpoint":
        out = Path(args[0])
        first = trainer(HybridParallelStrategy(tensor_parallel=2), 2, [])
        first.fit(GPTLightningModule(**MODEL), loader())
        first.save_checkpoint(out / "damaged.ckpt")
        if dist.get_rank() == 0:
            shard = max((out / "damaged.ckpt").glob("*.distcp"), key=lambda f: f.stat().st_size)
            data = shard.read_bytes()
            shard.write_bytes(data[: len(data) // 2])  # a save that died half-way through this file
        dist.barrier()
        second = trainer(HybridParallelStrategy(tensor_parallel=2), 4, [])
        second.fit(GPTLightningModule(**MODEL), loader(), ckpt_path=out / "damaged.ckpt")
        print("fit finished: the damaged checkpoint was loaded", flush=True)
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
