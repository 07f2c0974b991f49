"""Save and resume under ZeRO through Lightning, recording losses; the checkpoints are consolidated by the test.

    python tests/strategy/scripts/zero_checkpoint.py first  OUT_DIR LAYOUTS  # 4 steps, saved after step 2
    python tests/strategy/scripts/zero_checkpoint.py resume OUT_DIR LAYOUTS  # fresh processes: resume to step 4

``LAYOUTS``: comma-separated names of :data:`LAYOUTS`, each run in turn by the same processes
(start-up dominates), into ``OUT_DIR/<layout>/``. Run by ``tests/strategy/test_zero_checkpoint.py``
on 2 ranks with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set.

The models and data are the parity harness's (``tests/models/families.py``): nanoGPT (tied
``lm_head``, fused ``c_attn``) or Mixtral (experts), SGD with momentum, or AdamW (``eps=1e-5``;
DeepSpeed's CPU Adam under offload); Lightning's shuffling ``DistributedSampler`` over the
data-parallel ranks, so the test can train the same steps in one process with
``reference_dataloader``. An epoch has at least 4 batches per rank;
``ModelCheckpoint(every_n_train_steps=2)`` saves ``step2.ckpt`` mid-epoch while the run goes on
to step 4 (the uninterrupted run), and the resumed run must continue with batch 2 and reproduce
its steps 3-4. Writes ``OUT_DIR/<layout>/<run>.rank<r>.json``: the per-step losses of that rank and the
dtypes of its ``nn.Linear`` outputs in training (DeepSpeed's CUDA-only autocast check made to see the CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel import HybridParallelStrategy
from tests.distributed.gpu_checks import gpu_checks_on_the_cpu
from tests.models.families import build, make_dataloader

BATCH_SIZE, STEPS, FIRST_HALF, SEED = 2, 4, 2, 0
SAMPLES = 16  # 4 batches per rank and epoch on 2 data-parallel ranks: the save is mid-epoch
ADAM = {"optimizer": "adamw"}
NVME_PATH = "OUT_DIR/nvme"  # replaced in fit() by the folder beside the layouts' (the test's temp folder)
PIPELINE = dict(pipeline_parallel=2, micro_batches=2, pipeline_schedule="1f1b")

# name -> (HybridParallelStrategy kwargs, model family, model overrides); 2 ranks each.
LAYOUTS: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    "zero1": (dict(zero_stage=1), "nanogpt", {}),
    "zero2": (dict(zero_stage=2), "nanogpt", {}),
    # the GPT recipe's own AdamW: two param groups (decayed, undecayed), which DeepSpeed steps one by one
    "zero1_recipe_groups": (dict(zero_stage=1), "recipe_gpt", ADAM),
    "zero3_cpu_adam": (dict(zero_stage=3, offload="cpu"), "nanogpt", ADAM),
    "zero2_tp2": (dict(zero_stage=2, tensor_parallel=2), "nanogpt", ADAM),
    "zero1_pp2": (dict(zero_stage=1, **PIPELINE), "nanogpt", {}),
    "zero2_bf16": (dict(zero_stage=2), "nanogpt", {}),
    # FSDP2 gathering bf16 copies of the shards (zero_gather_dtype="compute"): ZeRO-2 keeps them between steps
    "zero2_gcompute_bf16": (dict(zero_stage=2, zero_gather_dtype="compute"), "nanogpt", {}),
    "zero3_gcompute_bf16": (dict(zero_stage=3, zero_gather_dtype="compute"), "nanogpt", ADAM),
    "zero3_tp2": (dict(zero_stage=3, tensor_parallel=2), "nanogpt", ADAM),  # FSDP2 (dp=1 here) of tp shards
    # FSDP2's CPU shards stepped by DeepSpeed's CPU Adam (zero/sharded_cpu_adam.py).
    "zero3_cpu_tp2": (dict(zero_stage=3, tensor_parallel=2, offload="cpu"), "nanogpt", ADAM),
    "zero3_ep2": (dict(zero_stage=3, expert_parallel=2), "hf_mixtral", ADAM),  # FSDP2 shards of expert slices
    # The same with Adam's states in files between steps (zero/sharded_nvme_adam.py).
    "zero3_nvme_tp2": (
        dict(zero_stage=3, tensor_parallel=2, offload="nvme", offload_path=NVME_PATH),
        "nanogpt",
        ADAM,
    ),
}
PRECISION = {
    name: "bf16-mixed" for name in ("zero2_bf16", "zero2_gcompute_bf16", "zero3_gcompute_bf16")
}  # others fp32
# On 4 ranks (``python ... first OUT_DIR LAYOUTS`` with WORLD_SIZE=4): expert slices sharded again over their
# 2 replicas (ep=2 x dp_replicate=2), each rank's piece one box of the stacked tensor in the files.
# ZeRO-1 with experts runs on DeepSpeed's engine, which shards over each expert's replicas: on 2 ranks
# with ep=2 there are none (refused: it would shard nothing), so its layouts are here.
LAYOUTS_FOUR: dict[str, tuple[dict[str, Any], str, dict[str, Any]]] = {
    "zero1_ep2_dp2": (dict(zero_stage=1, expert_parallel=2), "hf_mixtral", {}),
    "zero3_ep2_dp2": (dict(zero_stage=3, expert_parallel=2), "hf_mixtral", ADAM),
    # The same with the sequences split over cp=2 (dp = dp_batch 2 x cp 2 = dp_replicate 2 x ep 2): ep flattened.
    "zero3_cp2_ep2_dp2": (dict(zero_stage=3, expert_parallel=2, context_parallel=2), "hf_mixtral", ADAM),
}


# Resumed in another layout: name -> (the layout whose step2.ckpt is resumed, the strategy kwargs to resume with).
RESHARDS: dict[str, tuple[str, dict[str, Any]]] = {
    "zero1_to_dp": ("zero1", {}),  # out of ZeRO (the strategy's own data parallelism)
    "zero3_cpu_adam_to_zero2": ("zero3_cpu_adam", dict(zero_stage=2)),  # CPU Adam's state into torch's AdamW
    "zero3_cpu_adam_to_dp": (
        "zero3_cpu_adam",
        {},
    ),  # ... and out of ZeRO, whose loader wants every hyper-parameter
    "zero3_tp2_to_zero1_pp2": (
        "zero3_tp2",
        dict(zero_stage=1, **PIPELINE),
    ),  # FSDP2's shards into DeepSpeed's
    "zero3_cpu_tp2_to_zero3_tp2": (
        "zero3_cpu_tp2",
        dict(zero_stage=3, tensor_parallel=2),
    ),  # CPU Adam's DTensor states into torch's AdamW, both on FSDP2
    "zero3_nvme_tp2_to_zero3_cpu_tp2": (
        "zero3_nvme_tp2",
        dict(zero_stage=3, tensor_parallel=2, offload="cpu"),
    ),  # the states read back from their files into the in-memory CPU Adam
}
RESHARDS_FOUR: dict[str, tuple[str, dict[str, Any]]] = {
    "zero3_ep2_dp2_to_zero1_ep2_dp2": (
        "zero3_ep2_dp2",
        dict(zero_stage=1, expert_parallel=2),
    ),  # FSDP2's into DeepSpeed's
    "zero1_ep2_dp2_to_zero2_ep2_dp2": ("zero1_ep2_dp2", dict(zero_stage=2, expert_parallel=2)),  # and back
    "zero3_cp2_ep2_dp2_to_zero1_cp2_ep2_dp2": (
        "zero3_cp2_ep2_dp2",
        dict(zero_stage=1, expert_parallel=2, context_parallel=2),
    ),  # FSDP2's expert shards into DeepSpeed's groups, both on the factored mesh
}
# Resumed into tensor parallelism: its sharded matmuls sum in another order, so even the first resumed
# loss agrees within fp32 parity, not bit for bit.
RESHARDS_INTO_TENSOR_PARALLEL: dict[str, tuple[str, dict[str, Any]]] = {
    "zero1_pp2_to_zero3_tp2": (
        "zero1_pp2",
        dict(zero_stage=3, tensor_parallel=2),
    ),  # DeepSpeed's into FSDP2's
}


def data_parallel(layout: str, world_size: int = 2) -> int:
    """Ranks that read different batches (experts are carved out of them; tensor, pipeline and context ranks
    are not: context ranks share their batch)."""
    strategy = {**LAYOUTS, **LAYOUTS_FOUR}[layout][0]
    model_parallel = strategy.get("tensor_parallel", 1) * strategy.get("pipeline_parallel", 1)
    return world_size // (model_parallel * strategy.get("context_parallel", 1))


def samples(world_size: int) -> int:
    """4 batches per data-parallel rank and epoch: the save after step 2 is mid-epoch."""
    return SAMPLES * world_size // 2


class RecordLosses(L.Callback):
    """The per-step losses, and the dtypes the ``nn.Linear`` outputs of the training forwards had."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.linear_dtypes: dict[str, int] = {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        for sub in module.modules():
            if isinstance(sub, torch.nn.Linear):
                sub.register_forward_hook(self._linear)

    def _linear(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            self.linear_dtypes[str(output.dtype)] = self.linear_dtypes.get(str(output.dtype), 0) + 1

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(
    out: Path, run: str, layout: str, ckpt_path: Path | None = None, strategy: dict[str, Any] | None = None,
    world_size: int = 2,
) -> None:  # fmt: skip
    """``ckpt_path=None``: the uninterrupted run, saving ``step2.ckpt``; else the resume from it (in the
    layout's strategy, or in ``strategy``)."""
    strategy_kwargs, family, model_kwargs = {**LAYOUTS, **LAYOUTS_FOUR}[layout]
    strategy_kwargs = strategy_kwargs if strategy is None else strategy
    if "offload_path" in strategy_kwargs:  # in the test's own folder (each rank wipes its own part first)
        strategy_kwargs = {**strategy_kwargs, "offload_path": str(out.parent / "nvme")}
    save = ckpt_path is None
    L.seed_everything(SEED, verbose=False)
    model = build(family, **model_kwargs)
    recorder = RecordLosses()
    callbacks: list[L.Callback] = [recorder]
    if save:  # step2.ckpt (mid-epoch) and step4.ckpt, in on_train_batch_end
        callbacks.append(
            ModelCheckpoint(dirpath=out, filename="step{step}", auto_insert_metric_name=False, save_top_k=-1,
                            every_n_train_steps=FIRST_HALF)
        )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=HybridParallelStrategy(timeout=60, **strategy_kwargs),
        precision=PRECISION.get(layout, "32-true"), max_steps=STEPS, use_distributed_sampler=True,
        deterministic=True, callbacks=callbacks, logger=False, enable_checkpointing=save, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    with gpu_checks_on_the_cpu():  # DeepSpeed's autocast check sees the CPU's, as it sees CUDA's on a GPU
        trainer.fit(model, make_dataloader(BATCH_SIZE, samples(world_size)), ckpt_path=ckpt_path)
    result = {
        "losses": recorder.losses,
        "global_step": trainer.global_step,
        "linear_dtypes": recorder.linear_dtypes,
    }
    (out / f"{run}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main(mode: str, out: Path, layouts: str) -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    for layout in layouts.split(","):
        directory = out / layout
        directory.mkdir(parents=True, exist_ok=True)
        if mode == "first":
            fit(directory, "straight", layout, world_size=world_size)
        elif mode == "resume":
            fit(directory, "resumed", layout, ckpt_path=directory / "step2.ckpt", world_size=world_size)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    for name, (source, strategy) in {**RESHARDS, **RESHARDS_INTO_TENSOR_PARALLEL, **RESHARDS_FOUR}.items():
        if mode == "resume" and source in layouts.split(","):
            directory = out / name
            directory.mkdir(exist_ok=True)
            fit(directory, "resumed", source, ckpt_path=out / source / "step2.ckpt", strategy=strategy,
                world_size=world_size)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
