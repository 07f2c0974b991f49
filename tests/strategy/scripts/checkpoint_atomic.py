"""A save that crashes half-way must leave the last good checkpoint loadable, for an exact resume.

    python tests/strategy/scripts/checkpoint_atomic.py crash  OUT_DIR  # straight run; "raise" and "kill" faults
    python tests/strategy/scripts/checkpoint_atomic.py resume OUT_DIR  # fresh processes: resume both from last.ckpt

tp=2 on 2 ranks, the recipe GPT. ``ModelCheckpoint(save_last=True, every_n_train_steps=2)``
writes ``last.ckpt`` (a sharded folder) at steps 2, 4, 6, each time under the same name. At
step 4 the fault is injected into ``torch.distributed.checkpoint``'s file writer, after this
rank's shard file was written: the file is cut to half its size (a write that died half-way),
then either

- ``raise``: rank 0's writer raises ``OSError`` (a full disk); the error reaches every rank
  through the checkpoint's collectives and ``fit`` fails; the processes carry on to the next
  fault;
- ``kill``: rank 1 SIGKILLs itself (a crash); rank 0 fails on the dead peer and the job ends.

Written in place (what ``torch.distributed.checkpoint`` does by default), either fault would
have left ``last.ckpt`` with a truncated shard of step 4 and the metadata of step 2. The resume
launch loads ``last.ckpt`` of each fault and trains to step 6; records losses and data order in
``OUT_DIR/<run>.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import HybridParallelStrategy
from recipes.gpt.module import GPTLightningModule

MODEL = dict(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1)
STEPS, SAVE_EVERY, FAULT_AT = 6, 2, 4
_WRITE_DATA = FileSystemWriter.write_data


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[list[int]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.batches.append([trainer.current_epoch, i, *batch[0][:, 0].tolist()])


def inject(kind: str, at_step: int, trainer_ref: list[L.Trainer]) -> None:
    """Break ``FileSystemWriter.write_data`` of the save at ``at_step`` (see the module docstring)."""
    original = _WRITE_DATA

    def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        result = original(self, plan, planner)
        if trainer_ref[0].global_step != at_step:
            return result
        result.wait()
        rank = dist.get_rank()
        shard = max(Path(self.path).glob(f"__{rank}_*.distcp"), key=lambda f: f.stat().st_size)
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
        if kind == "kill" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "raise" and rank == 0:
            raise OSError(28, "No space left on device (injected)")
        return result

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


def loader() -> DataLoader:
    tokens = torch.randint(128, (40, 17), generator=torch.Generator().manual_seed(3))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=True)


def fit(out: Path, run: str, ckpt_dir: Path | None = None, resume: bool = False) -> L.Trainer:
    L.seed_everything(0)
    record = Record()
    callbacks: list[L.Callback] = [record]
    if ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=SAVE_EVERY)
        )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(tensor_parallel=2, timeout=60),
        max_steps=STEPS, use_distributed_sampler=False, callbacks=callbacks, logger=False,
        enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer_ref[0] = trainer
    error = None
    try:
        trainer.fit(
            GPTLightningModule(**MODEL), loader(), ckpt_path=ckpt_dir / "last.ckpt" if resume else None
        )
    except (Exception, CheckpointException) as caught:  # the injected fault, on every rank
        error = f"{type(caught).__name__}: {caught}"
    result = {
        "losses": record.losses,
        "batches": record.batches,
        "global_step": trainer.global_step,
        "error": error,
    }
    (out / f"{run}.rank{trainer.global_rank}.json").write_text(json.dumps(result))
    return trainer


trainer_ref: list[Any] = [None]


def main(mode: str, out: Path) -> None:
    torch.set_num_threads(1)
    if mode == "crash":
        fit(out, "straight")
        inject("raise", FAULT_AT, trainer_ref)
        fit(out, "raise", out / "raise")
        inject("kill", FAULT_AT, trainer_ref)
        fit(out, "kill", out / "kill")
    elif mode == "resume":
        for fault in ("raise", "kill"):
            fit(out, f"resumed_{fault}", out / fault, resume=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
