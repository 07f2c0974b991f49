"""A compiled step under two pipeline stages (CPU inductor), eager and with recomputation, against eager.

    python tests/strategy/scripts/compiled_pipeline.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Two ranks, ``pipeline_parallel=2``, 4 micro-batches, the GPT recipe at test size; per mode (eager,
``compile=True``, ``compile=True`` with full and with selective checkpointing) the losses of three
steps, this rank's parameters' sum of squares after them, whether its blocks were compiled, the graphs dynamo
made. Writes ``OUT_DIR/compiled_pipeline.rank{r}.json``.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.pipeline.stages import SkippedBlock
from tests.models.families import build, make_dataloader

MODES: dict[str, dict[str, Any]] = {
    "eager": {},
    "compiled": {"compile": True},
    "compiled_full": {"compile": True, "activation_checkpointing": "full"},
    "compiled_selective": {"compile": True, "activation_checkpointing": "selective"},
    # two stages per rank: each block's forward is gated by the active stage, recomputed in the graph
    "eager_interleaved": {"pipeline_schedule": "interleaved_1f1b"},
    "compiled_full_interleaved": {"compile": True, "activation_checkpointing": "full",
                                  "pipeline_schedule": "interleaved_1f1b"},
}  # fmt: skip


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results = {}
    for name, kwargs in MODES.items():
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        L.seed_everything(0, verbose=False)
        record, model = Record(), build("recipe_gpt", n_layer=4)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=3, logger=False, callbacks=[record],
            strategy=HybridParallelStrategy(pipeline_parallel=2, micro_batches=4, timeout=300, **kwargs),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, make_dataloader(4, 12))
        held = [b for b in model.model.transformer.h if not isinstance(b, SkippedBlock)]
        results[name] = {
            "losses": record.losses,
            "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None for b in held),
            "held_blocks": len(held),
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
            # this rank's parameters after the steps, in float64 (the updates the gradients made)
            "parameters": float(sum(p.detach().double().square().sum() for p in model.parameters())),
        }
    (out_dir / f"compiled_pipeline.rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
