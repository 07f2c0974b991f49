"""Checkpoints of weights tensor parallelism stores in a row layout: resume, reshard, consolidate, initialise.

    python tests/strategy/scripts/row_layout_checkpoints.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

Two zoo families on 2 ranks (``tests/models/zoo.py``): Gemma (one k/v head: stored on both
tensor-parallel ranks) and Phi-3 (fused q|k|v of unequal widths: stored in another row order). For
each, with AdamW (its states are stored like the weights):

- ``straight``: tp=2, 4 steps;
- ``first``: tp=2, 2 steps, then a sharded save (``step2.ckpt``) and a consolidated one (``step2.full.ckpt``);
- ``resumed`` / ``resumed_full``: tp=2 from each, to step 4 (must equal ``straight`` exactly);
- ``resharded``: pp=2 from the sharded tp=2 checkpoint, to step 4 (the same losses within 1e-5);
- ``initialised``: tp=2 with ``init_weights=`` the one-process module's state dict (``init.pt``): its
  first loss is the one-process module's loss on the same batch.

Every run writes its losses and, on rank 0, the user's view of the trained weights (each stored tensor put
back in the user's rows), to ``OUT_DIR/<family>/<run>.json``; the ``first`` run also the names and
shapes of its sharded checkpoint's entries and of the consolidated file's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.tensor_parallel.row_layout import row_layout
from tests.models.hf import HFZooModule

FAMILIES = ("gemma", "phi3")
BATCH, BATCHES, SEQ = 4, 4, 16


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def _model(family: str) -> L.LightningModule:
    torch.manual_seed(1234)
    return HFZooModule(family, block_size=SEQ, optimizer="adamw")


def _loader() -> DataLoader:
    tokens = torch.randint(128, (BATCH * BATCHES, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def _user_weights(module: L.LightningModule) -> dict[str, list]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in module.named_parameters():
        tensor = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
        if not tensor.is_meta:
            layout = row_layout(param)
            out[name] = (layout.user(tensor) if layout is not None else tensor).flatten()[:64].tolist()
    return out


def fit(out: Path, family: str, run: str, steps: int, **arguments: Any) -> L.Trainer:
    ckpt_path, save_to = arguments.pop("ckpt_path", None), arguments.pop("save_to", None)
    layout = arguments.pop("layout", {"tensor_parallel": 2})
    L.seed_everything(0, verbose=False)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=HybridParallelStrategy(timeout=60, **layout, **arguments),
        max_steps=steps, callbacks=[record], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    model = _model(family)
    trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    result: dict[str, Any] = {"losses": record.losses}
    if save_to is not None:
        trainer.save_checkpoint(save_to)
        trainer.strategy._save_distributed_checkpoint = False
        trainer.save_checkpoint(save_to.with_suffix(".full.ckpt"))
        trainer.strategy._save_distributed_checkpoint = True
    if "tensor_parallel" in layout:
        result["weights"] = _user_weights(model)
    if trainer.global_rank == 0:
        (out / f"{run}.json").write_text(json.dumps(result))
    return trainer


def main(root: Path) -> None:
    torch.set_num_threads(1)
    for family in FAMILIES:
        out = root / family
        out.mkdir(exist_ok=True)
        checkpoint = out / "step2.ckpt"
        fit(out, family, "straight", 4)
        fit(out, family, "first", 2, save_to=checkpoint)
        fit(out, family, "resumed", 4, ckpt_path=checkpoint)
        fit(out, family, "resumed_full", 4, ckpt_path=checkpoint.with_suffix(".full.ckpt"))
        fit(
            out,
            family,
            "resharded",
            4,
            ckpt_path=checkpoint,
            layout={"pipeline_parallel": 2, "micro_batches": 2},
        )
        if (
            torch.distributed.get_rank() == 0
        ):  # the one-process module's weights and its loss on the first batch
            model = _model(family)
            x, y = next(iter(_loader()))
            logits = model.model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            torch.save(model.state_dict(), out / "init.pt")
            (out / "one_process.json").write_text(json.dumps({"first_loss": float(loss)}))
        torch.distributed.barrier()
        fit(out, family, "initialised", 1, init_weights=str(out / "init.pt"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
