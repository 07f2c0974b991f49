"""The same module through a second entry point under ZeRO on FSDP2 (the parallelized module is reused).

    python tests/strategy/scripts/zero_refit.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Mixtral under ``zero_stage=2, expert_parallel=2`` (FSDP2; ZeRO-2 keeps whole parameters between steps):
``fit`` 2 steps, then ``fit`` 2 more steps in a new Trainer (the first leaves the gathered whole
parameters registered, as ZeRO-2 keeps them between steps; a validation forward does the same). Every rank writes
``OUT_DIR/zero_refit.rank{r}.json``: how far the second fit moved the weights (the norm of the change of
this rank's shards) and whether its optimizer holds the shards.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from lightning_parallel import HybridParallelStrategy
from tests.models.families import build, make_dataloader


def _shards(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = module.state_dict()  # FSDP2 hands out the shards, whatever is registered
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _trainer(devices: int, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_checkpointing=False,
        strategy=HybridParallelStrategy(zero_stage=2, expert_parallel=2, timeout=60), limit_val_batches=1,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    devices = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    L.seed_everything(0, verbose=False)
    module = build("hf_mixtral")
    data = make_dataloader(2, 2 * 2 * devices)
    first = _trainer(devices, 2)
    first.fit(module, data)
    before = _shards(module)
    second = _trainer(devices, 2)
    second.fit(module, data)
    after = _shards(module)
    moved = sum(float((after[k] - before[k]).float().norm()) for k in before if before[k].is_floating_point())
    optimized = [p for group in second.optimizers[0].param_groups for p in group["params"]]
    result = {"moved": moved, "optimizer_holds_shards": all(isinstance(p, DTensor) for p in optimized)}
    (out_dir / f"zero_refit.rank{second.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
