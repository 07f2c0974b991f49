"""Activation bytes held for backward per rank under context parallelism, through the Trainer.

    python tests/strategy/scripts/context_memory.py OUT_DIR   # 4 ranks; RANK/WORLD_SIZE/MASTER_* from the launcher

On 4 ranks (one process group), the recipe GPT (fp32, AdamW) trains one step for each of
``context_parallel`` = 1 (dp=4), 2 (dp=2 x cp=2) and 4, ring and Ulysses, at 2 and at 4 blocks, with
sequences of ``LENGTH`` tokens (every rank: ``BATCH`` sequences of its data replica). The
saved-tensor hooks of ``ActivationMemoryMonitor`` count each step. Two depths give the parts:
the bytes of one block (the difference, halved) and those outside the stack (the rest).
Rank r writes ``OUT_DIR/context_memory.rank{r}.json``; the bounds are in
``tests/context_parallel/test_context_memory.py``.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import ActivationMemoryMonitor, HybridParallelStrategy
from recipes.gpt.module import GPTLightningModule

BATCH, LENGTH, VOCAB = 2, 64, 128
LAYOUTS, DEPTHS = ((1, "ring"), (2, "ring"), (4, "ring"), (2, "ulysses"), (4, "ulysses")), (2, 4)


def _bytes(context_parallel: int, mode: str, layers: int) -> int:
    L.seed_everything(0, verbose=False)
    model = GPTLightningModule(vocab_size=VOCAB, block_size=LENGTH, n_layer=layers, n_head=4, n_embd=32)
    tokens = torch.randint(VOCAB, (4 * BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    monitor = ActivationMemoryMonitor()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=HybridParallelStrategy(context_parallel=context_parallel, context_parallel_mode=mode, timeout=60),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[monitor],
    )  # fmt: skip
    trainer.fit(model, loader)
    return monitor.steps[0].total


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    measured = {f"cp{c}_{mode}_layers{n}": _bytes(c, mode, n) for c, mode in LAYOUTS for n in DEPTHS}
    rank = torch.distributed.get_rank()
    measured.update(batch=BATCH, length=LENGTH)
    (Path(out_dir) / f"context_memory.rank{rank}.json").write_text(json.dumps(measured))


if __name__ == "__main__":
    main(sys.argv[1])
