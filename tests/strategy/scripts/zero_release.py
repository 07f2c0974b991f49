"""What of a ZeRO fit on DeepSpeed's engine outlives its Trainer (tests/strategy/test_zero_release.py).

    python tests/strategy/scripts/zero_release.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Per ZeRO stage (1, 2, 3 on DeepSpeed's engine, dp=2), in one process: a two-step ``fit``, a checkpoint saved
after it (``trainer.save_checkpoint``, the way a user keeps the final model) and a validation run, then the
Trainer, strategy and module dropped and Python's collector run. Records whether the engine, the module and the Trainer are still
alive (weak references), and the checkpoint's size. With ``LP_KEEP_ENGINE=1`` the strategy's release of the
engine is switched off (the negative control: DeepSpeed's own references keep all three).
Writes ``OUT_DIR/zero_release.rank{r}.json``.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_parallel import HybridParallelStrategy
from tests.models.families import build, make_dataloader

ENVIRONMENT = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _fit_and_save(stage: int, out: Path) -> tuple[weakref.ref, weakref.ref, weakref.ref, int]:
    model = build("recipe_gpt", optimizer="adamw")
    strategy = HybridParallelStrategy(zero_stage=stage, timeout=60)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, make_dataloader(2, 8))
    path = out / f"zero{stage}.ckpt"
    trainer.save_checkpoint(path)
    trainer.validate(model, make_dataloader(2, 4), verbose=False)  # the model runs after the release
    size = (
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if path.is_dir()
        else path.stat().st_size
    )
    return weakref.ref(strategy.zero_engine), weakref.ref(model), weakref.ref(trainer), size


def main(out: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if os.environ.get("LP_KEEP_ENGINE"):
        import lightning_parallel.strategy.checkpointing as checkpointing

        checkpointing.release_engine = lambda engine: None  # type: ignore[assignment]
    environment = {k: os.environ[k] for k in ENVIRONMENT}  # Lightning's teardown removes some
    result: dict[str, Any] = {}
    for stage in (1, 2, 3):
        os.environ.update(environment)
        engine, module, trainer, size = _fit_and_save(stage, out)
        gc.collect()
        result[str(stage)] = {
            "engine_alive": engine() is not None,
            "module_alive": module() is not None,
            "trainer_alive": trainer() is not None,
            "checkpoint_bytes": size,
        }
    rank = environment["RANK"]
    (out / f"zero_release.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
