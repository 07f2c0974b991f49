"""Compressed data-parallel all-reduce: bytes per step and the loss after 200 steps, against uncompressed.

    PYTHONPATH=. python -m benchmarks.gradient_compression            # 2 CPU ranks, tiny GPT recipe, 200 steps

``HybridParallelStrategy(gradient_compression=...)`` on 2 data-parallel ranks (torch's DDP
reducer with a communication hook) trains the tiny recipe GPT (tiny.yaml: 2 layers, width 64,
vocabulary 320, 64 tokens) with its own AdamW and schedule on the embedded corpus, for
``--steps`` steps per configuration: no compression, bf16, fp16, PowerSGD at rank 1, 2 and 4
(``start_iter=10``: plain all-reduce for the first 10 steps, as PowerSGD's authors warm up).
Every configuration starts from the same weights and sees the same batches.

Reported per configuration: the all-reduce payload per compressed step (bytes handed to
``all_reduce`` per process; the uncompressed reducer's is the gradient size), the ratio to
uncompressed, the mean training loss of the last 20 steps and the validation loss at the end.
Nothing is asserted: it is a measurement (the tests count bytes exactly).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    finish_worker,
    init_process_group,
    launch,
    machine,
    quiet_lightning,
    recipe_data,
    recipe_model,
    table,
)

SHAPE = dict(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_embd=64)
BATCH = 16


def configurations() -> dict[str, Any]:
    from lightning_parallel import PowerSGD

    return {
        "none": None,
        "bf16": "bf16",
        "fp16": "fp16",
        "PowerSGD r=1": PowerSGD(rank=1, start_iter=10),
        "PowerSGD r=2": PowerSGD(rank=2, start_iter=10),
        "PowerSGD r=4": PowerSGD(rank=4, start_iter=10),
    }


def rank_main(out: Path, steps: int) -> None:
    import lightning as L

    from lightning_parallel import HybridParallelStrategy
    from lightning_parallel.comm import count_all_reduce_bytes, gradient_bytes

    torch.set_num_threads(1)
    rank = init_process_group()
    quiet_lightning()
    data = recipe_data(SHAPE["block_size"], BATCH)
    results: dict[str, Any] = {}

    class Record(L.Callback):
        def __init__(self, log: Any) -> None:
            self.counts, self.bytes, self.losses, self.seen = log, [], [], 0

        def on_train_batch_end(
            self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, i: int
        ) -> None:
            self.losses.append(float(outputs["loss"]))
            self.bytes.append(self.counts.bytes - self.seen)
            self.seen = self.counts.bytes

    for name, compression in configurations().items():
        L.seed_everything(1337, verbose=False)
        model = recipe_model(**SHAPE, learning_rate=3e-3, warmup_steps=10, lr_decay_steps=steps)
        with count_all_reduce_bytes() as log:
            record = Record(log)
            trainer = L.Trainer(
                accelerator="cpu", devices=2, strategy=HybridParallelStrategy(gradient_compression=compression),
                max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, callbacks=[record], limit_val_batches=10, val_check_interval=steps,
                gradient_clip_val=1.0, num_sanity_val_steps=0,
            )  # fmt: skip
            trainer.fit(model, datamodule=data)
        val = trainer.callback_metrics.get("val_loss")
        results[name] = {
            "bytes_last_step": record.bytes[-1],
            "last_losses": record.losses[-20:],
            "val_loss": float(val) if val is not None else None,
            "gradient_bytes": gradient_bytes(model.parameters()),
        }
    if rank == 0:
        (out / "result.json").write_text(json.dumps(results))
    finish_worker()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)  # set for the ranks
    args = parser.parse_args(argv)
    if args.out is not None:
        rank_main(args.out, args.steps)
        return
    print(f"# gradient_compression: tiny GPT recipe, 2 data-parallel ranks, {args.steps} steps; {machine()}")
    out = launch("benchmarks.gradient_compression", ["--steps", str(args.steps)], nprocs=2, timeout_s=1800)
    results = json.loads((out / "result.json").read_text())
    plain = results["none"]
    rows = []
    for name, r in results.items():
        sent = r["bytes_last_step"] if name != "none" else r["gradient_bytes"]
        train = statistics.mean(r["last_losses"])
        rows.append([name, f"{sent / 1024:.1f} KiB", f"{plain['gradient_bytes'] / sent:.1f}x",
                     f"{train:.4f}", f"{train - statistics.mean(plain['last_losses']):+.4f}",
                     f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"])  # fmt: skip
    print(table(["all-reduce", "payload per step", "less than plain", "train loss (last 20)", "vs plain",
                 "val loss"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
