"""The order of FSDP2's parameter gathers against the blocks' forwards, ZeRO-3 with and without CPU offload.

    python tests/strategy/scripts/zero_prefetch.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

The recipe's GPT (3 blocks) one step under ``zero_stage=3, zero_engine="fsdp2"``, ``offload="cpu"`` and
``None``. Every all-gather (``torch.distributed.all_gather_single``, what FSDP2 calls) and every block's
forward (a pre-hook, which runs after FSDP2's own) is recorded in order during the step; every rank writes
``OUT_DIR/zero_prefetch.rank{r}.json``: for each run, the gathers issued before each block's forward.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_parallel import HybridParallelStrategy
from recipes.gpt.module import GPTLightningModule

EVENTS: list[str] = []
# FSDP2's all-gather: torch 2.13 calls ``all_gather_single``, 2.11 ``all_gather_into_tensor``
_GATHER_NAME = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_GATHER = getattr(dist, _GATHER_NAME)


def _recorded_gather(*args: Any, **kwargs: Any) -> Any:
    EVENTS.append("gather")
    return _GATHER(*args, **kwargs)


class _BlockForwards(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for block in pl_module.model.transformer.h:
            block.register_forward_pre_hook(lambda module, args: EVENTS.append("block"))

    def on_train_batch_start(self, *args: Any) -> None:
        EVENTS.clear()

    def on_before_backward(self, *args: Any) -> None:
        EVENTS.append("backward")  # the forward's gathers end here


def _gathers_before_each_block(offload: str | None, devices: int) -> list[int]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (2 * devices, 17))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_BlockForwards()],
        strategy=HybridParallelStrategy(zero_stage=3, offload=offload, zero_engine="fsdp2", timeout=60),
    )  # fmt: skip
    trainer.fit(GPTLightningModule(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32), data)
    forward = EVENTS[: EVENTS.index("backward")]
    return [forward[:i].count("gather") for i, event in enumerate(forward) if event == "block"]


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    devices = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    rank = int(os.environ["RANK"])
    setattr(dist, _GATHER_NAME, _recorded_gather)  # FSDP2 looks it up on the module at each call
    result = {str(offload): _gathers_before_each_block(offload, devices) for offload in ("cpu", None)}
    (out_dir / f"zero_prefetch.rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
