"""Validation, test, predict and logging under pp=2 (2 ranks), for ``tests/strategy/test_pipeline_eval.py``.

    python tests/strategy/scripts/pipeline_eval.py OUT_DIR

The recipe GPT (its ``validation_step`` logs ``val_loss`` with ``sync_dist`` and a torchmetrics
``Perplexity`` object) with its initial weights: ``validate`` and ``predict`` results, the
metrics every rank sees, then one short ``fit`` whose ``train_loss`` must reach rank 0 (the
first stage, where Lightning's logger writes) although only the last stage computes it.
Writes ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import HybridParallelStrategy
from recipes.gpt.module import GPTLightningModule

MODEL = dict(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32)


class PredictingGPT(GPTLightningModule):
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self.log("test_loss", torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def data() -> TensorDataset:
    tokens = torch.randint(
        MODEL["vocab_size"], (12, MODEL["block_size"] + 1), generator=torch.Generator().manual_seed(3)
    )
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def main(out: Path) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    model = PredictingGPT(**MODEL)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_steps=2, num_sanity_val_steps=0, use_distributed_sampler=False,
        strategy=HybridParallelStrategy(pipeline_parallel=2, micro_batches=2, timeout=60),
    )  # fmt: skip
    # Batches of 4 and a last one of 2 (12 = 4 + 4 + 4; predict uses 5: 5 + 5 + 2): evaluation
    # accepts sizes the micro-batch count does not divide.
    validated = trainer.validate(model, DataLoader(data(), batch_size=4))[0]
    tested = trainer.test(model, DataLoader(data(), batch_size=4))[0]
    predictions = trainer.predict(model, DataLoader(data(), batch_size=5))
    trainer.fit(model, DataLoader(data(), batch_size=4))
    result = {
        "initial": initial,
        "validated": {k: float(v) for k, v in validated.items()},
        "tested": {k: float(v) for k, v in tested.items()},
        "predictions": [p.cpu() for p in predictions],
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "global_step": trainer.global_step,
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
