"""Pruned weights through a sharded checkpoint, a resume in another layout, and ``export``.

    python tests/compression/scripts/prune_checkpoint.py OUT_DIR   # 2 ranks

tp=2 trains the recipe GPT 4 steps under a gradual ``MagnitudePruning`` (events after steps 0, 2, 4 of 6)
and saves after step 3 (``ModelCheckpoint``, sharded); pp=2 resumes it (resharded: fused q|k|v row
shards read by stages) to step 6, where the last event prunes again. Rank 0 then exports the final
checkpoint to one file. Writes ``OUT_DIR/<run>.rank<r>.json``: the callback's counts and state,
and the zeros each rank's weights hold.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel import HybridParallelStrategy, export_checkpoint
from lightning_parallel.compression import MagnitudePruning
from lightning_parallel.precision.layout_sum import local_values
from tests.models.families import build, make_dataloader

SCHEDULE = {"amount": 0.6, "start_step": 0, "every_n_steps": 2, "end_step": 4, "ramp": "linear"}


def fit(out: Path, run: str, layout: dict, steps: int, resume: Path | None) -> None:
    L.seed_everything(0)
    pruning = MagnitudePruning(**SCHEDULE)
    seen: list[dict] = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
            seen.append({"step": pruning.steps_done, "pruned": pruning.pruned, "sparsity": pruning.sparsity})

    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[pruning, Watch(),
        ModelCheckpoint(dirpath=out / run, filename="step{step}", auto_insert_metric_name=False, save_top_k=-1,
                        every_n_train_steps=3)],
        strategy=HybridParallelStrategy(timeout=60, **layout),
    )  # fmt: skip
    model = build("recipe_gpt", n_layer=4)
    trainer.fit(model, make_dataloader(4, 48), ckpt_path=resume)  # one replica in both layouts
    local_zeros = sum(int((local_values(p) == 0).sum()) for p in pruning._params)
    result = {"seen": seen, "selected": pruning.selected, "pruned": pruning.pruned, "local_zeros": local_zeros,
              "last_event_step": pruning.last_event_step}  # fmt: skip
    (out / f"{run}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main(out: Path) -> None:
    torch.set_num_threads(1)
    fit(out, "tp2", {"tensor_parallel": 2}, 3, None)
    fit(out, "pp2", {"pipeline_parallel": 2, "micro_batches": 2}, 6, out / "tp2" / "step3.ckpt")
    dist.barrier()
    if dist.get_rank() == 0:
        export_checkpoint(out / "pp2" / "step6.ckpt", out / "exported.safetensors")
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main(Path(sys.argv[1]))
