"""Host syncs per training step that the project's code makes, per layout (counted on CPU).

    python tests/strategy/scripts/host_syncs.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Two ranks; per layout (``LAYOUTS``) a fit of ``STEPS`` steps under ``tests/sync_counter.SyncCounter``.
Each step is counted from the start of its batch to its end (the first step, which also sets up, is
left out). Writes ``OUT_DIR/host_syncs.rank{r}.json``: per layout, the MoE layers, the data-parallel buckets
launched, and per counted step the syncs by ``kind @ file:line``; and the negative control: the syncs counted while the grouped
experts' fallback (``_padded_bmm``, which reads its group sizes) runs once.
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
from lightning_parallel.data_parallel.buckets import _Bucket
from lightning_parallel.experts.experts import _padded_bmm
from lightning_parallel.experts.layer import MoE
from lightning_parallel.optim import Adafactor
from tests.models.families import build, make_dataloader
from tests.sync_counter import SyncCounter

STEPS = 3
# name: (family, strategy arguments, Trainer arguments)
LAYOUTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "tp2": ("hf_llama", {"tensor_parallel": 2, "sequence_parallel": True}, {"gradient_clip_val": 0.1}),
    "tp2_adafactor": ("nanogpt", {"tensor_parallel": 2}, {}),  # Adafactor on DTensor parameters
    "pp2": (
        "recipe_gpt",
        {"pipeline_parallel": 2, "micro_batches": 4},
        {"gradient_clip_val": 0.1},
    ),  # validates
    "ep2": ("recipe_moe", {"expert_parallel": 2, "moe_aux_loss_coef": 0.01}, {"gradient_clip_val": 0.1}),
    # ZeRO on each engine, and context parallelism (their own paths: DeepSpeed's step, FSDP2's hooks, the ring).
    "zero2": ("nanogpt", {"zero_stage": 2}, {"gradient_clip_val": 0.1}),
    "zero3_fsdp2": ("nanogpt", {"zero_stage": 3, "zero_engine": "fsdp2"}, {"gradient_clip_val": 0.1}),
    "cp2_ring": ("recipe_gpt", {"context_parallel": 2}, {}),
}


class PerStep(L.Callback):
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter
        self.steps: list[dict[str, int]] = []
        self.eval_steps: list[dict[str, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.counter.reset()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(self._counted())

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.counter.reset()

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.eval_steps.append(self._counted())

    def _counted(self) -> dict[str, int]:
        counts = self.counter.reset()
        return {f"{kind} @ {where}": n for (kind, where), n in sorted(counts.items())}


def _count_bucket_launches() -> list[int]:
    """Counts the data-parallel buckets launched (``data_parallel/buckets.py``): the layout took that path."""
    launched = [0]
    original = _Bucket.launch

    def launch(self: _Bucket, group: Any) -> None:
        launched[0] += 1
        original(self, group)

    _Bucket.launch = launch  # type: ignore[method-assign]
    return launched


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results = {}
    launched = _count_bucket_launches()
    for name, (family, strategy_kwargs, trainer_kwargs) in LAYOUTS.items():
        launched[0] = 0
        L.seed_everything(0, verbose=False)
        counter = SyncCounter()
        probe = PerStep(counter)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=STEPS, logger=False, callbacks=[probe], limit_val_batches=2,
            num_sanity_val_steps=0, val_check_interval=2,
            strategy=HybridParallelStrategy(timeout=60, **strategy_kwargs), enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
        )  # fmt: skip
        model = build(family)
        if name.endswith("adafactor"):
            model.configure_optimizers = lambda model=model: Adafactor(model.parameters(), lr=1e-2)  # type: ignore[method-assign]
        with counter.counting():
            trainer.fit(model, make_dataloader(4, 4 * STEPS), make_dataloader(4, 8, seed=1))
        moe_layers = sum(isinstance(m, MoE) for m in model.modules())
        results[name] = {"moe_layers": moe_layers, "steps": probe.steps[1:], "eval_steps": probe.eval_steps,
                         "bucket_launches": launched[0]}  # fmt: skip
    control = SyncCounter()
    with control.counting():
        _padded_bmm(torch.ones(3, 2), torch.ones(2, 2, 2), torch.tensor([1, 2]))
    results["control"] = {f"{kind} @ {where}": n for (kind, where), n in control.counts.items()}
    (out_dir / f"host_syncs.rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
