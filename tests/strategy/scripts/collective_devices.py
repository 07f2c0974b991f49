"""Every collective of a training run gets tensors on the group's communication device (what NCCL needs).

    python tests/strategy/scripts/collective_devices.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Two ranks; per layout (``LAYOUTS``) one short fit with validation and a checkpoint saved, under
``tests/device_guard.HostTensorGuard``: the host tensors the project makes are marked and every
``torch.distributed`` collective checks its arguments. The last layout is the negative control: the
vote helper's flag made on the default device (the bug a GPU run would die of), which the guard must
report. Writes ``OUT_DIR/collective_devices.rank{r}.json``: per layout, the collectives seen and the
violations ``(collective, file:line)``.
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
from tests.device_guard import HostTensorGuard
from tests.models.families import build, make_dataloader

DEEP = {"n_layer": 4}  # two stages per rank under the V schedules
# name: (family, strategy arguments, Trainer arguments)
LAYOUTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "tp2_sp_clip": (
        "hf_llama",
        {"tensor_parallel": 2, "sequence_parallel": True},
        {"gradient_clip_val": 0.1},
    ),
    "tp2_row_copies": (
        "zoo_gemma",
        {"tensor_parallel": 2},
        {"gradient_clip_val": 0.1},
    ),  # one k/v head, two ranks
    "pp2_1f1b_clip": ("nanogpt", {"pipeline_parallel": 2, "micro_batches": 2}, {"gradient_clip_val": 0.1}),
    "pp2_zbv": ("nanogpt", {"pipeline_parallel": 2, "micro_batches": 2, "pipeline_schedule": "zbv"}, {}),
    "ep2_aux": ("recipe_moe", {"expert_parallel": 2, "moe_aux_loss_coef": 0.01}, {"gradient_clip_val": 0.1}),
    "cp2_ring": ("recipe_gpt", {"context_parallel": 2}, {}),
    "cp2_ulysses": ("recipe_gpt", {"context_parallel": 2, "context_parallel_mode": "ulysses"}, {}),
    "dp2_powersgd": ("nanogpt", {"gradient_compression": "powersgd"}, {}),
    "zero2_ep2": ("hf_mixtral", {"zero_stage": 2, "expert_parallel": 2}, {"gradient_clip_val": 0.1}),
    "zero1": ("nanogpt", {"zero_stage": 1}, {"gradient_clip_val": 0.1}),  # DeepSpeed's engine on dp2
    "zero3_fsdp2": ("nanogpt", {"zero_stage": 3, "zero_engine": "fsdp2"}, {"gradient_clip_val": 0.1}),
    "control_host_flag": ("nanogpt", {"tensor_parallel": 2}, {}),
}


def fit(name: str, out_dir: Path) -> HostTensorGuard:
    family, strategy_kwargs, trainer_kwargs = LAYOUTS[name]
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=2, logger=False, limit_val_batches=1, val_check_interval=2,
        strategy=HybridParallelStrategy(timeout=60, **strategy_kwargs), default_root_dir=out_dir / name,
        enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    model = build(family, **(DEEP if strategy_kwargs.get("pipeline_schedule") == "zbv" else {}))
    guard = HostTensorGuard()
    with guard.watching():
        if name.startswith("control"):
            import lightning_parallel.comm.agreement as agreement

            agreement.communication_device = lambda group=None: None  # type: ignore[assignment]
        trainer.fit(model, make_dataloader(2, 8), make_dataloader(2, 4, seed=1))
        trainer.save_checkpoint(out_dir / name / "final.ckpt")
    return guard


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results = {}
    for name in LAYOUTS:
        guard = fit(name, out_dir)
        results[name] = {"collectives": guard.collectives, "violations": sorted(set(guard.violations))}
    (out_dir / f"collective_devices.rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
