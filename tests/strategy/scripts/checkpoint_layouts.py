"""Checkpoints across layouts: resharding on load, weights in from one file, weights out to one file.

    python tests/strategy/scripts/checkpoint_layouts.py write2 OUT_DIR  # 2 ranks: tp2, dp2, pp2, ep2, ep1, zero3_ep2, cp2,
                                                                        # pp2_shared, dp2_shared
    python tests/strategy/scripts/checkpoint_layouts.py world4 OUT_DIR  # 4 ranks: pp4, dp4, cp4; read pp2, dp2, cp2
    python tests/strategy/scripts/checkpoint_layouts.py read2  OUT_DIR  # 2 ranks: read the others; references

Every run trains a test family (``recipe_gpt`` with 4 blocks, ``recipe_moe``, or ``per_layer_inputs`` whose first
and last blocks share a module; SGD) for 6 steps
on the same global batches (8 samples: 8 / dp per rank, Lightning's ``DistributedSampler``, 4
steps per epoch) and starts from the same weights ``W``: a single-file state dict of the
unparallelised module (``OUT_DIR/<family>.safetensors``, and as ``torch.save``'d ``.pt`` of the
inner model, without the LightningModule's ``model.`` prefix), loaded with
``HybridParallelStrategy(init_weights=...)``. A writer saves ``<layout>/step0.ckpt`` before its
first step and ``<layout>/step3.ckpt`` in the middle of the first epoch (``ModelCheckpoint``);
a reader resumes another layout's ``step3.ckpt`` to step 6. ``read2`` ends with the one-process
runs from ``W`` (rank 0, process group closed), the uninterrupted run every layout must follow.
Writes ``OUT_DIR/<run>.rank<r>.json`` (losses, data order, global step).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel import HybridParallelStrategy
from tests.environment import LAUNCHER_VARIABLES
from tests.models.families import build, make_dataloader, reference_dataloader

STEPS, SAVE_AT, GLOBAL_BATCH, NUM_SAMPLES, W_SEED = 6, 3, 8, 32, 99
# The MoE dropless and without the load-balancing loss: both depend on which tokens a rank sees together,
# so only then do the data-parallel layout (ep1) and the one-process run compute the same function.
FAMILY_KWARGS: dict[str, dict[str, Any]] = {
    "recipe_gpt": {"n_layer": 4},
    "recipe_moe": {"capacity_factor": None, "aux_loss_coef": 0.0},
    "per_layer_inputs": {"shared_side": True},  # a module the first and last blocks share: on both stages
}

# name: (family, world size, strategy arguments, the weights file it starts from)
LAYOUTS: dict[str, tuple[str, int, dict[str, Any], str]] = {
    "tp2": ("recipe_gpt", 2, dict(tensor_parallel=2), "recipe_gpt.safetensors"),
    "dp2": ("recipe_gpt", 2, {}, "recipe_gpt.safetensors"),  # tp=1: the unsharded layout of 2 ranks
    "pp2": ("recipe_gpt", 2, dict(pipeline_parallel=2, micro_batches=2), "recipe_gpt.inner.pt"),
    "ep2": ("recipe_moe", 2, dict(expert_parallel=2), "recipe_moe.safetensors"),
    "ep1": ("recipe_moe", 2, {}, "recipe_moe.safetensors"),
    # ZeRO-3 on FSDP2: each ep slice a DTensor over its replicas when the file's experts are cut in.
    "zero3_ep2": ("recipe_moe", 2, dict(zero_stage=3, expert_parallel=2), "recipe_moe.safetensors"),
    "pp4": ("recipe_gpt", 4, dict(pipeline_parallel=4, micro_batches=4), "recipe_gpt.safetensors"),
    "dp4": ("recipe_gpt", 4, {}, "recipe_gpt.safetensors"),
    # Context parallelism: the parameters replicated over cp, so any cp degree reads any other's checkpoint.
    "cp2": ("recipe_gpt", 2, dict(context_parallel=2), "recipe_gpt.safetensors"),
    "cp4": ("recipe_gpt", 4, dict(context_parallel=4), "recipe_gpt.safetensors"),
    # Zamba's shared transformer: each stage saves the copy its own blocks call, under their names.
    "pp2_shared": (
        "per_layer_inputs",
        2,
        dict(pipeline_parallel=2, micro_batches=2),
        "per_layer_inputs.safetensors",
    ),
    "dp2_shared": ("per_layer_inputs", 2, {}, "per_layer_inputs.safetensors"),
}
EXPORTED = ("tp2", "pp2", "ep2", "zero3_ep2", "pp2_shared")  # save step0.ckpt, which the tests export
# (writer, reader): each resharding pair of issue 6, both directions.
PAIRS = [
    ("tp2", "dp2"), ("dp2", "tp2"), ("pp2", "pp4"), ("pp4", "pp2"),
    ("ep2", "ep1"), ("ep1", "ep2"), ("dp4", "dp2"), ("dp2", "dp4"),
    ("tp2", "pp2"), ("pp2", "tp2"),  # fused q|k|v row shards read by stages, and back
    ("cp2", "dp2"), ("dp2", "cp2"), ("cp2", "cp4"), ("cp4", "cp2"),
    ("pp2_shared", "dp2_shared"), ("dp2_shared", "pp2_shared"),
]  # fmt: skip


class Record(L.Callback):
    """Losses and data order; ``step0.ckpt`` before the first step (the weights as loaded)."""

    def __init__(self, step0: Path | None) -> None:
        self.step0 = step0
        self.losses: list[float] = []
        self.batches: list[list[int]] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.step0 is not None:
            trainer.save_checkpoint(self.step0)

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))
        self.batches.append([trainer.current_epoch, i, len(batch[0])])


def write_weights(out: Path) -> None:
    """``W`` of each family: the unparallelised module's state dict from another seed. Every rank writes the
    same bytes under a name of its own and renames it into place (no process group exists yet)."""
    from safetensors.torch import save_file

    rank = os.environ["RANK"]
    for family, kwargs in FAMILY_KWARGS.items():
        state = {
            k: v.contiguous().clone() for k, v in build(family, seed=W_SEED, **kwargs).state_dict().items()
        }
        save_file(state, out / f"{family}.{rank}.tmp")
        os.replace(out / f"{family}.{rank}.tmp", out / f"{family}.safetensors")
        inner = {
            k[len("model.") :]: v for k, v in state.items()
        }  # the inner model, as a HF user would save it
        torch.save(inner, out / f"{family}.inner.{rank}.tmp")
        os.replace(out / f"{family}.inner.{rank}.tmp", out / f"{family}.inner.pt")


def fit(out: Path, run: str, layout: str, resume_from: str | None = None) -> None:
    family, world_size, strategy_kwargs, weights = LAYOUTS[layout]
    L.seed_everything(0)
    data_parallel = (  # the batches that differ: context ranks share theirs
        world_size
        // strategy_kwargs.get("tensor_parallel", 1)
        // strategy_kwargs.get("pipeline_parallel", 1)
        // strategy_kwargs.get("context_parallel", 1)
    )
    writer = resume_from is None
    record = Record(out / layout / "step0.ckpt" if writer and layout in EXPORTED else None)
    callbacks: list[L.Callback] = [record]
    if writer:
        callbacks.append(
            ModelCheckpoint(  # step3.ckpt, step6.ckpt
                dirpath=out / layout, filename="step{step}", auto_insert_metric_name=False, save_top_k=-1,
                every_n_train_steps=SAVE_AT,
            )
        )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, max_steps=STEPS, callbacks=callbacks, logger=False,
        strategy=HybridParallelStrategy(init_weights=out / weights, timeout=60, **strategy_kwargs),
        enable_checkpointing=writer, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    model = build(family, **FAMILY_KWARGS[family])  # the default seed: W must overwrite these weights
    loader = make_dataloader(GLOBAL_BATCH // data_parallel, NUM_SAMPLES)
    ckpt_path = out / resume_from / "step3.ckpt" if resume_from else None
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    result = {"losses": record.losses, "batches": record.batches, "global_step": trainer.global_step}
    (out / f"{run}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def one_process_references(out: Path) -> None:
    """Each family from ``W`` in ONE process: no process group, no launcher variables."""
    dist.destroy_process_group()
    for key in LAUNCHER_VARIABLES:
        os.environ.pop(key, None)
    for family, kwargs in FAMILY_KWARGS.items():
        L.seed_everything(0)
        record = Record(None)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[record], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(
            build(family, seed=W_SEED, **kwargs), reference_dataloader(GLOBAL_BATCH, 1, NUM_SAMPLES, 0)
        )
        (out / f"reference_{family}.json").write_text(json.dumps({"losses": record.losses}))


def main(mode: str, out: Path) -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ["WORLD_SIZE"])
    if mode == "write2":
        write_weights(out)
        for layout in ("tp2", "dp2", "pp2", "ep2", "ep1", "zero3_ep2", "cp2", "pp2_shared", "dp2_shared"):
            fit(out, layout, layout)
    elif mode == "world4":
        for layout in ("pp4", "dp4", "cp4"):
            fit(out, layout, layout)
        for writer, reader in PAIRS:
            if LAYOUTS[reader][1] == world_size and LAYOUTS[writer][1] == 2:
                fit(out, f"{writer}_to_{reader}", reader, resume_from=writer)
    elif mode == "read2":
        for writer, reader in PAIRS:
            if LAYOUTS[reader][1] == world_size:
                fit(out, f"{writer}_to_{reader}", reader, resume_from=writer)
        if dist.get_rank() == 0:
            one_process_references(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
