"""Quality of each technique on the tiny GPT recipe, one process: printed, and asserted loosely.

The data is ``TokenWindows(data="learnable")``: a successor table over 16 letters with a random
jump every 16 tokens, learnt by the tiny GPT within tens of steps. Each bound says why it is what
it is; the numbers are printed (``pytest -s``) for the record.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

from lightning_parallel.compression import (
    KnowledgeDistillation,
    MagnitudePruning,
    QuantizationAwareTraining,
    convert_qat,
    post_training_quantize,
)
from tests.models.families import TokenWindows, build

STEPS, BATCH = 60, 8


VALIDATION = 64
# One stream (its successor table depends on its length): training windows first, the last 64 held out.
WINDOWS = TokenWindows(2 * STEPS * BATCH + VALIDATION, data="learnable")


def _loader(steps: int) -> DataLoader:
    """``steps`` batches of training windows, or the held-out windows with ``steps=0``."""
    first = len(WINDOWS) - VALIDATION
    indices = range(first, len(WINDOWS)) if steps == 0 else range(steps * BATCH)
    return DataLoader(Subset(WINDOWS, list(indices)), batch_size=BATCH)


def _fit(model: L.LightningModule, steps: int = STEPS, callbacks: list | None = None) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks or [])  # fmt: skip
    trainer.fit(model, _loader(steps))
    return model


@torch.no_grad()
def _val_loss(model: torch.nn.Module) -> float:
    model.eval()
    losses = [
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) for x, y in _loader(0)
    ]
    return float(torch.stack(losses).mean())


def _gpt(**kwargs: object) -> L.LightningModule:
    return build("recipe_gpt", optimizer="adamw", **{"learning_rate": 3e-3, **kwargs})


def test_half_the_weights_pruned_before_training_end_near_the_dense_model() -> None:
    dense = _val_loss(_fit(_gpt()))
    pruning = MagnitudePruning(0.5)
    pruned = _val_loss(_fit(_gpt(), callbacks=[pruning]))
    start = _val_loss(_gpt())
    print(f"\nprune 50%: start {start:.3f}, dense {dense:.3f}, pruned {pruned:.3f}")
    assert pruning.pruned == pruning.selected // 2
    assert pruned < dense + 0.1 * (start - dense), "within a tenth of what dense training gained"


def test_the_qat_model_converted_is_no_worse_than_post_training_quantisation() -> None:
    """Both from the same float model trained 60 steps, then 30 more steps float (PTQ after) or under QAT.

    On this model int4 costs little: PTQ is 4e-4 above the float loss (measured), too small a gap to
    measure a recovered fraction (torchao reports ~90% on Llama3-8B, where the gap is large). What is
    asserted is what would catch a broken QAT or conversion: the converted model within 1e-3 of PTQ's loss.
    """
    base = _fit(_gpt())
    state = {k: v.clone() for k, v in base.state_dict().items()}
    control, tuned = _gpt(learning_rate=1e-3), _gpt(learning_rate=1e-3)
    control.load_state_dict(state)
    tuned.load_state_dict(state)
    float_loss = _val_loss(_fit(control, STEPS // 2))
    ptq = _val_loss(post_training_quantize(control, "8da4w"))
    qat = _val_loss(convert_qat(_fit(tuned, STEPS // 2, [QuantizationAwareTraining("8da4w")]), "8da4w"))
    print(f"\n8da4w: float {float_loss:.4f}, PTQ {ptq:.4f}, QAT converted {qat:.4f}")
    assert qat < ptq + 1e-3


def test_a_distilled_student_beats_the_same_student_alone() -> None:
    """A 32-wide student, 30 steps, alone or distilled (T=1, alpha=0.5) from a 128-wide teacher trained 120 steps.

    The data is nearly deterministic, so the teacher adds little beyond the labels (measured: 1.648
    against 1.658; softer targets, T >= 2, were worse at 30 steps); the assertion is that distillation
    trains the student, engaged, and not worse than alone.
    """
    teacher = _fit(_gpt(n_embd=128), 2 * STEPS)
    teacher_loss = _val_loss(teacher)
    alone = _val_loss(_fit(_gpt(n_embd=32), STEPS // 2))
    kd = KnowledgeDistillation(teacher.model, temperature=1.0, alpha=0.5)
    distilled = _val_loss(_fit(_gpt(n_embd=32), STEPS // 2, [kd]))
    print(f"\nKD: teacher {teacher_loss:.3f}, student alone {alone:.3f}, distilled {distilled:.3f}")
    assert kd.last_kd_loss is not None and float(kd.last_kd_loss) > 0
    assert distilled < alone
