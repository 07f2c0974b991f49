"""Compression recipes for the GPT: each technique against the same model trained without it, one command each.

    python -m recipes.gpt.compress distil   # a wider teacher distilled into the tiny GPT (tp=2, vocabulary-sharded KL)
    python -m recipes.gpt.compress qat      # the tiny GPT trained, then QAT-fine-tuned to int8/int4 (dp=2)
    python -m recipes.gpt.compress prune    # the tiny GPT pruned to 50% gradually while training (tp=2)
    python -m recipes.gpt.compress all --steps 600 --amount 0.7   # the three, one after the other

Every run uses the embedded corpus, two CPU processes (or every GPU of the node) and prints the
validation losses it compares on rank 0. ``--teacher`` distils from a checkpoint of the recipe's
model of any size (``consolidate_checkpoint``; its shape from ``--teacher-config``, e.g.
``configs/medium.yaml``) instead of training a small teacher first.
"""

from __future__ import annotations

import argparse
from importlib import resources
from typing import Any

import lightning as L
import torch
import yaml
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightning_parallel import HybridParallelStrategy, consolidate_checkpoint
from lightning_parallel.compression import (
    KnowledgeDistillation,
    MagnitudePruning,
    QuantizationAwareTraining,
    convert_qat,
    post_training_quantize,
)
from recipes.gpt.data import TokenDataModule
from recipes.gpt.model import GPT, GPTConfig
from recipes.gpt.module import GPTLightningModule

TINY = {"vocab_size": 320, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64, "dropout": 0.0}
TEACHER = {**TINY, "n_layer": 4, "n_embd": 128}  # what a CPU trains in a minute; --teacher for real ones


def _trainer(steps: int, callbacks: list[Any], **strategy: Any) -> L.Trainer:
    gpu = torch.cuda.is_available()
    return L.Trainer(
        accelerator="gpu" if gpu else "cpu", devices=torch.cuda.device_count() if gpu else 2, max_steps=steps,
        strategy=HybridParallelStrategy(**strategy), callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=20, num_sanity_val_steps=0,
    )  # fmt: skip


def _fit(shape: dict, steps: int, callbacks: list[Any] | None = None, state: dict | None = None, **strategy: Any) -> tuple[GPTLightningModule, float]:  # fmt: skip
    L.seed_everything(1337, verbose=False)
    module = GPTLightningModule(**shape, learning_rate=3e-3, warmup_steps=max(1, steps // 10))
    if state is not None:
        module.load_state_dict(state)
    trainer = _trainer(steps, callbacks or [], **strategy)
    data = TokenDataModule(block_size=shape["block_size"], batch_size=16)
    trainer.fit(module, data)
    return module, float(trainer.validate(module, data, verbose=False)[0]["val_loss"])


def _rank_zero() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _say(line: str) -> None:
    if _rank_zero():
        print(line, flush=True)


@torch.no_grad()
def _local_val_loss(model: torch.nn.Module, block_size: int) -> float:
    """Validation loss of a model in this process (a converted quantised one), on the recipe's held-out tokens."""
    data = TokenDataModule(block_size=block_size, batch_size=16)
    data.setup("validate")
    losses = [
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        for i, (x, y) in zip(range(20), data.val_dataloader(), strict=False)
    ]
    return float(torch.stack(losses).mean())


def distil(steps: int, teacher_path: str | None, teacher_config: str | None) -> None:
    if teacher_path:
        shape = yaml.safe_load(resources.files("recipes.gpt").joinpath("configs", teacher_config or "medium.yaml").read_text())["model"]  # fmt: skip
        keys = {k: shape[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")}
        teacher = GPT(GPTConfig(**keys, dropout=0.0))
        teacher.load_state_dict(consolidate_checkpoint(teacher_path, prefix="model."))
        teacher_loss = float("nan")
    else:
        trained, teacher_loss = _fit(TEACHER, 2 * steps, tensor_parallel=2, sequence_parallel=True)
        teacher = GPT(GPTConfig(**TEACHER))
        teacher.load_state_dict({k[len("model.") :]: v for k, v in _full_state(trained).items()})
    _, alone = _fit(TINY, steps, tensor_parallel=2, loss_parallel=True)
    kd = KnowledgeDistillation(teacher, temperature=1.0, alpha=0.5)
    _, distilled = _fit(TINY, steps, [kd], tensor_parallel=2, loss_parallel=True)
    _say(f"distil: teacher val_loss {teacher_loss:.4f}; student alone {alone:.4f}, distilled {distilled:.4f}")


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank's full copy of the (tensor-parallel) weights: torch's distributed state dict, gathered."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


def qat(steps: int) -> None:
    base, float_loss = _fit(TINY, steps)
    state = _full_state(base)
    _, tuned_float = _fit(TINY, steps // 2, state=state)
    qat_module, qat_fake = _fit(TINY, steps // 2, [QuantizationAwareTraining("8da4w")], state=state)
    qat_state = _full_state(qat_module)
    if _rank_zero():
        ptq_model = GPTLightningModule(**TINY)
        ptq_model.load_state_dict(state)
        ptq = _local_val_loss(post_training_quantize(ptq_model.eval(), "8da4w"), TINY["block_size"])
        converted = GPTLightningModule(**TINY)
        converted.load_state_dict(qat_state, strict=False)
        qat_int = _local_val_loss(convert_qat(converted.eval(), "8da4w"), TINY["block_size"])
        print(f"qat 8da4w: float {float_loss:.4f} (fine-tuned {tuned_float:.4f}); PTQ {ptq:.4f}; "
              f"QAT fake-quantised {qat_fake:.4f}, converted {qat_int:.4f}", flush=True)  # fmt: skip


def prune(steps: int, amount: float) -> None:
    _, dense = _fit(TINY, steps, tensor_parallel=2)
    every = max(1, steps // 10)  # ten events over the first half, then fine-tuning at the final sparsity
    pruning = MagnitudePruning(
        amount, start_step=0, every_n_steps=every, end_step=(steps // 2 // every) * every
    )
    _, pruned = _fit(TINY, steps, [pruning], tensor_parallel=2)
    _say(f"prune {pruning.sparsity:.0%} ({pruning.pruned} of {pruning.selected} weights): dense"
         f" {dense:.4f}, pruned {pruned:.4f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("technique", choices=("distil", "qat", "prune", "all"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--amount", type=float, default=0.5)
    parser.add_argument("--teacher", default=None, help="a checkpoint of the recipe's model to distil from")
    parser.add_argument(
        "--teacher-config", default=None, help="its config in recipes/gpt/configs (medium.yaml)"
    )
    args = parser.parse_args(argv)
    if args.technique in ("distil", "all"):
        distil(args.steps, args.teacher, args.teacher_config)
    if args.technique in ("qat", "all"):
        qat(args.steps)
    if args.technique in ("prune", "all"):
        prune(args.steps, args.amount)


if __name__ == "__main__":
    main()
