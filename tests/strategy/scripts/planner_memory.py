"""What each rank really holds, per layout, for the planner's exactness test (tests/planner/test_memory_exact.py).

    python tests/strategy/scripts/planner_memory.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Two ranks; per layout of ``LAYOUTS`` a fit of ``STEPS`` steps. Recorded on every rank, in bytes of this
process: the parameters it holds (DTensor local shards; DeepSpeed ZeRO-3's partitions), their gradients
just before the optimizer steps, the optimizer's state tensors after the last step (DeepSpeed: its fp32
partition of the weights too), and the activations of each step (``ActivationMemoryMonitor``: held in
all, and the peak alive at once). Writes ``OUT_DIR/planner_memory.rank{r}.json``.
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
from torch.distributed.tensor import DTensor

from lightning_parallel import ActivationMemoryMonitor, HybridParallelStrategy
from tests.models.families import SEQ_LEN, build, make_dataloader

STEPS = 2
BATCH = 4  # per rank
# name: (family, family overrides, strategy arguments)
LAYOUTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "dp2_full": ("recipe_gpt", {"optimizer": "adamw"}, {"activation_checkpointing": "full"}),
    "dp2_selective": ("hf_llama", {}, {"activation_checkpointing": "selective"}),
    "tp2": ("hf_llama", {}, {"tensor_parallel": 2}),
    "tp2_sp": ("recipe_gpt", {"optimizer": "adamw"}, {"tensor_parallel": 2, "sequence_parallel": True}),
    # one stage a rank; two (8 blocks): interleaved 1F1B's rank 0 holds more micro-batches of its first stage than
    # of its second at the peak, and under the zero-bubble schedules a micro-batch stays until its weight pass
    **{
        f"pp2_{schedule}": (
            "recipe_gpt",
            {"optimizer": "adamw", "n_layer": 4 if schedule in ("1f1b", "gpipe") else 8},
            {"pipeline_parallel": 2, "micro_batches": 4, "pipeline_schedule": schedule},
        )
        for schedule in ("1f1b", "gpipe", "interleaved_1f1b", "zbv", "interleaved_zero_bubble", "dualpipev")
    },
    # saved tensors compressed: fp32 to bf16 (the GPT), to fp8 (Llama, its Python norms probed); under sp the
    # gathered inputs kept as slices are not compressed; across stages
    "dp2_bf16_compression": ("recipe_gpt", {"optimizer": "adamw"}, {"activation_compression": "bf16"}),
    "dp2_fp8_compression": ("hf_llama", {}, {"activation_compression": "fp8"}),
    "tp2_sp_bf16_compression": (
        "recipe_gpt",
        {"optimizer": "adamw"},
        {"tensor_parallel": 2, "sequence_parallel": True, "activation_compression": "bf16"},
    ),
    "pp2_1f1b_fp8_compression": (
        "recipe_gpt",
        {"optimizer": "adamw", "n_layer": 4},
        {"pipeline_parallel": 2, "micro_batches": 4, "activation_compression": "fp8"},
    ),
    # saved tensors in host memory but each micro-batch's last block: plain, under sp (slices stay), selective
    # (its kept outputs stay), across stages
    "dp2_offload": ("recipe_gpt", {"optimizer": "adamw", "n_layer": 4}, {"activation_offload": True}),
    "tp2_sp_offload": (
        "recipe_gpt",
        {"optimizer": "adamw", "n_layer": 4},
        {"tensor_parallel": 2, "sequence_parallel": True, "activation_offload": True},
    ),
    "dp2_selective_offload": (
        "hf_llama",
        {},
        {"activation_checkpointing": "selective", "activation_offload": True},
    ),
    "pp2_1f1b_offload": (
        "recipe_gpt",
        {"optimizer": "adamw", "n_layer": 8},
        {"pipeline_parallel": 2, "micro_batches": 4, "activation_offload": True},
    ),
    # two stages a rank: each stage's own last block stays (the saver keys its groups by stage and micro-batch)
    "pp2_interleaved_1f1b_offload": (
        "recipe_gpt",
        {"optimizer": "adamw", "n_layer": 8},
        {
            "pipeline_parallel": 2,
            "micro_batches": 4,
            "pipeline_schedule": "interleaved_1f1b",
            "activation_offload": True,
        },
    ),
    "ep2": ("recipe_moe", {}, {"expert_parallel": 2}),
    # each tensor rank routes its slice of the sequence through whole experts
    "tp2_sp_moe": ("hf_mixtral", {}, {"tensor_parallel": 2, "sequence_parallel": True}),
    "zero1": ("recipe_gpt", {"optimizer": "adamw"}, {"zero_stage": 1}),
    "zero2": ("recipe_gpt", {"optimizer": "adamw"}, {"zero_stage": 2}),
    "zero3": ("recipe_gpt", {"optimizer": "adamw"}, {"zero_stage": 3}),
    "ep2_zero2": ("recipe_moe", {}, {"expert_parallel": 2, "zero_stage": 2}),
    "cp2": ("hf_llama", {}, {"context_parallel": 2}),  # each rank half of every sequence, ring attention
    "auto": ("recipe_gpt", {"optimizer": "adamw", "n_layer": 4}, {}),  # HybridParallelStrategy.auto on TINY
}
TINY_MEMORY = (
    2.2e6  # bytes: dp2 does not fit the GPT above at BATCH x SEQ_LEN, two stages with recomputation do
)


def tiny_cluster() -> Any:
    from dataclasses import replace

    from lightning_parallel.planner.cluster import CLUSTERS

    return replace(CLUSTERS["h100"], name="tiny", memory_bytes=int(TINY_MEMORY))


def make_strategy(name: str, model: L.LightningModule) -> HybridParallelStrategy:
    if name == "auto":
        return HybridParallelStrategy.auto(model, devices=2, batch_size=BATCH, sequence_length=SEQ_LEN,
                                           cluster=tiny_cluster(), precision="32-true", strategy={"timeout": 60})  # fmt: skip
    return HybridParallelStrategy(timeout=60, **LAYOUTS[name][2])


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.device.type != "meta"]


class Holdings(L.Callback):
    """Parameter bytes and gradient bytes before each optimizer step, optimizer states after the last."""

    def __init__(self) -> None:
        self.parameters = 0
        self.gradients = 0
        self.optimizer = 0

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        params = _parameters(pl_module)
        self.parameters = sum(_bytes(getattr(p, "ds_tensor", p)) for p in params)
        self.gradients = sum(_bytes(p.grad) for p in params if p.grad is not None)
        partitions = getattr(trainer.strategy.optimizers[0], "single_partition_of_fp32_groups", None) or []
        self.gradients += sum(_bytes(t.grad) for t in partitions if t.grad is not None)  # DeepSpeed stage 1/2

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        optimizer = trainer.strategy.optimizers[0]
        inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizer wraps torch's
        seen: set[int] = set()
        total = 0
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    local = value._local_tensor if isinstance(value, DTensor) else value
                    if local.untyped_storage().data_ptr() not in seen:
                        seen.add(local.untyped_storage().data_ptr())
                        total += _bytes(value)
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
            total += sum(_bytes(t) for t in getattr(optimizer, name, []) or [])
        self.optimizer = total


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    results = {}
    only = sys.argv[2:]  # layouts to run (all when none): for looking at one by hand
    for name, (family, overrides, _) in LAYOUTS.items():
        if only and name not in only:
            continue
        L.seed_everything(0, verbose=False)
        holdings, monitor = Holdings(), ActivationMemoryMonitor()
        model = build(family, **overrides)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, max_steps=STEPS, logger=False, callbacks=[holdings, monitor],
            strategy=make_strategy(name, model), enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(model, make_dataloader(BATCH, BATCH * 2 * STEPS))
        results[name] = {
            "parameters": holdings.parameters,
            "gradients": holdings.gradients,
            "optimizer": holdings.optimizer,
            "activations": [step.total for step in monitor.steps],
            "activation_peaks": [step.peak for step in monitor.steps],
            "alive_after_step": [step.alive_after_step for step in monitor.steps],
            "offloaded": [step.offloaded for step in monitor.steps],
            "degrees": trainer.strategy.dims.degrees if trainer.strategy.dims else None,
        }
    (out_dir / f"planner_memory.rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
