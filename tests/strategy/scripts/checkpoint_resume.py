"""Save and resume a sharded checkpoint in the same layout (tp=2 on 2 ranks), recording losses.

    python tests/strategy/scripts/checkpoint_resume.py first  OUT_DIR [LAYOUT]  # 6 steps straight; 3 steps + save
    python tests/strategy/scripts/checkpoint_resume.py resume OUT_DIR [LAYOUT]  # fresh processes: resume to step 6

``LAYOUT`` is ``tp2`` (default), ``pp2`` (two pipeline stages, 2 micro-batches, 1F1B; the
sharded checkpoint only: each stage writes its own blocks) or ``ep2`` (the MoE recipe with its
4 experts sharded over 2 ranks; sharded checkpoint only).

Two checkpoints of the same state are written after step 3: ``step3.ckpt``, sharded (a folder of
``torch.distributed.checkpoint`` files, the strategy's default), and ``step3.full.ckpt``, one
consolidated file (``save_distributed_checkpoint=False``); the resume run loads each in turn.

Run by ``tests/strategy/test_checkpoint_resume.py`` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set.
Writes ``OUT_DIR/<run>.rank<r>.json``: the per-step training losses of that rank, and (rank 0,
``straight`` run) the plan's parameter sizes after sharding, for the CLI's arithmetic.
The data is a fixed, unshuffled loader of 3 batches per epoch and the first half runs exactly
one epoch, so the checkpoint is at an epoch boundary and the resumed run sees exactly the
batches of steps 4-6. (A checkpoint taken mid-epoch, e.g. by ``max_steps=3`` on a longer epoch,
restarts that epoch's non-stateful loader from its first batch: Lightning's behaviour, not ours.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import HybridParallelStrategy
from recipes.gpt.module import GPTLightningModule

MODEL = dict(
    vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32, learning_rate=3e-3, warmup_steps=2,
    lr_decay_steps=6, weight_decay=0.1,
)  # fmt: skip
BATCH_SIZE, BATCHES_PER_EPOCH = 4, 3


class RecordLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def loader() -> DataLoader:
    tokens = torch.randint(MODEL["vocab_size"], (BATCH_SIZE * BATCHES_PER_EPOCH, MODEL["block_size"] + 1),
                           generator=torch.Generator().manual_seed(7))  # fmt: skip
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH_SIZE, shuffle=False)


LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": dict(tensor_parallel=2),
    "pp2": dict(pipeline_parallel=2, micro_batches=2, pipeline_schedule="1f1b"),
    "ep2": dict(expert_parallel=2),
}


def build_model(layout: str) -> L.LightningModule:
    if layout == "ep2":
        from recipes.moe.module import MoEGPTLightningModule

        return MoEGPTLightningModule(**MODEL, num_experts=4, top_k=2, capacity_factor=1.25)
    return GPTLightningModule(**MODEL)


def fit(
    out: Path,
    run: str,
    epochs: int,
    ckpt_path: Path | None = None,
    save_to: Path | None = None,
    layout: str = "tp2",
) -> None:
    L.seed_everything(0)
    model = build_model(layout)
    recorder = RecordLosses()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(timeout=60, **LAYOUTS[layout]),
        precision="32-true", max_epochs=epochs, use_distributed_sampler=False, callbacks=[recorder],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)  # sharded
        if layout == "tp2":
            trainer.strategy._save_distributed_checkpoint = False
            trainer.save_checkpoint(save_to.with_suffix(".full.ckpt"))  # consolidated
    result: dict[str, Any] = {"losses": recorder.losses, "global_step": trainer.global_step}
    if trainer.global_rank == 0 and layout == "tp2":
        plan = trainer.strategy.plan
        result["parameter_shards"] = {name: list(sizes) for name, sizes in plan.parameter_shards.items()}
    (out / f"{run}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main(mode: str, out: Path, layout: str = "tp2") -> None:
    torch.set_num_threads(1)
    checkpoint = out / "step3.ckpt"
    if mode == "first":
        fit(out, "straight", epochs=2, layout=layout)
        fit(out, "first_half", epochs=1, save_to=checkpoint, layout=layout)
    elif mode == "resume-sharded":  # a checkpoint another layout wrote (resharding on load)
        fit(out, "resumed", epochs=2, ckpt_path=checkpoint, layout=layout)
    elif mode == "resume":
        fit(out, "resumed", epochs=2, ckpt_path=checkpoint, layout=layout)
        if layout == "tp2":
            fit(out, "resumed_full", epochs=2, ckpt_path=checkpoint.with_suffix(".full.ckpt"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
