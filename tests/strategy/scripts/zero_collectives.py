"""Collectives per optimizer step of ZeRO-2/3 (FSDP2) under two pipeline stages with 4 micro-batches.

    python tests/strategy/scripts/zero_collectives.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

nanoGPT, pp=2 x dp=2, ``micro_batches=4``, three steps; ``torch.distributed.all_gather_single`` (2.11: ``all_gather_into_tensor``) and
``reduce_scatter_single`` (what FSDP2 calls) are counted per training step from the second on (the
first also gathers the initial shards). Every rank writes ``OUT_DIR/zero_collectives.rank{r}.json``:
per stage, the FSDP2 units on the rank and the gathers and reduce-scatters of each counted step; also
with ``zero_reshard="micro_batch"``.
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
from tests.models.families import build, make_dataloader

COUNTS = {"all_gather": 0, "reduce_scatter": 0}


def _counting(name: str, original: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        COUNTS[name] += 1
        return original(*args, **kwargs)

    return wrapper


class PerStep(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self.units = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        COUNTS.update(all_gather=0, reduce_scatter=0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps.append(dict(COUNTS))
        runner = trainer.strategy.pipeline_runner
        self.units = len(
            runner.fsdp_units if runner is not None else trainer.strategy.parallelized.gradients.in_backward
        )


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    # FSDP2's collectives: torch 2.13 calls ``*_single``, 2.11 ``all_gather_into_tensor``/``reduce_scatter_tensor``.
    single = hasattr(dist, "all_gather_single")
    gather, scatter = ("all_gather_single", "reduce_scatter_single") if single else (
        "all_gather_into_tensor", "reduce_scatter_tensor")  # fmt: skip
    setattr(dist, gather, _counting("all_gather", getattr(dist, gather)))
    setattr(dist, scatter, _counting("reduce_scatter", getattr(dist, scatter)))
    devices = int(os.environ["WORLD_SIZE"])
    results = {}
    # zero_reshard="micro_batch": the memory asked for, at micro_batches times the communication.
    for stage, reshard in ((2, "step"), (3, "step"), (2, "micro_batch"), (3, "micro_batch")):
        L.seed_everything(0, verbose=False)
        probe = PerStep()
        trainer = L.Trainer(
            accelerator="cpu", devices=devices, max_steps=3, callbacks=[probe], logger=False,
            strategy=HybridParallelStrategy(
                zero_stage=stage, pipeline_parallel=2, micro_batches=4, zero_reshard=reshard, timeout=60
            ),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(build("nanogpt", n_layer=4), make_dataloader(4, 3 * 4 * 2))
        name = f"zero{stage}" + ("" if reshard == "step" else "_per_micro_batch")
        results[name] = {"units": probe.units, "steps": probe.steps[1:]}
    # ZeRO-2 with expert parallelism, no stages (ep=2 x dp_replicate=2): the expert units are their own, over
    # their 2 replicas; every unit still gathers once (after the step) and reduce-scatters once per step.
    L.seed_everything(0, verbose=False)
    probe = PerStep()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=3, callbacks=[probe], logger=False,
        strategy=HybridParallelStrategy(zero_stage=2, expert_parallel=2, timeout=60),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(build("hf_mixtral"), make_dataloader(2, 3 * 2 * devices))
    results["zero2_ep2"] = {"units": probe.units, "steps": probe.steps[1:]}
    (out_dir / f"zero_collectives.rank{dist.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
