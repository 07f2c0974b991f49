"""``compile=True`` compiles each block this rank runs, and nothing of another pipeline stage's."""

from __future__ import annotations

from lightning_parallel.parallelize import compile_blocks
from lightning_parallel.pipeline.stages import SkippedBlock
from lightning_parallel.plans.detect import block_names
from tests.models.families import build


def test_every_block_is_compiled_lazily() -> None:
    model = build("nanogpt")
    compile_blocks(model, block_names(model))
    blocks = list(model.model.transformer.h)
    assert blocks and all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    assert getattr(model.model, "_compiled_call_impl", None) is None  # only the blocks


def test_blocks_held_by_other_stages_are_left_alone() -> None:
    model = build("nanogpt", n_layer=4)
    names = [f"model.transformer.h.{i}" for i in range(4)]
    skipped = SkippedBlock(names[3], template=None)  # type: ignore[arg-type]
    model.model.transformer.h[3] = skipped
    compile_blocks(model, names)
    assert all(
        getattr(model.model.transformer.h[i], "_compiled_call_impl", None) is not None for i in range(3)
    )
    assert getattr(skipped, "_compiled_call_impl", None) is None


def _losses(compile: bool, checkpointing: str | None) -> tuple[list[float], object]:
    import lightning as L
    import torch

    from lightning_parallel import HybridParallelStrategy
    from tests.models.families import make_dataloader

    class Record(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, i) -> None:  # type: ignore[no-untyped-def]
            self.losses.append(float(outputs["loss"]))

    torch.manual_seed(0)
    record, model = Record(), build("recipe_gpt")
    strategy = HybridParallelStrategy(compile=compile, activation_checkpointing=checkpointing, timeout=60)
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False, callbacks=[record],
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              ).fit(model, make_dataloader(2, 6))  # fmt: skip
    return record.losses, model


def test_a_compiled_step_with_activation_checkpointing_trains_like_the_eager_one() -> None:
    """torch.compile (CPU inductor) of blocks whose forward is recomputed, full and selective: dynamo
    accepts the checkpoint (full passes no context_fn; selective's are dispatch modes) and the losses
    are the eager run's. Negative control: the compiled blocks really are compiled."""
    import torch

    from lightning_parallel.memory.checkpointing import is_checkpointed

    eager, _ = _losses(False, None)
    for mode in ("full", "selective"):
        torch._dynamo.reset()  # each mode compiles afresh (and leaves no graph to later tests)
        losses, model = _losses(True, mode)
        blocks = list(model.model.transformer.h)
        assert all(getattr(b, "_compiled_call_impl", None) is not None and is_checkpointed(b) for b in blocks)
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, eager, strict=True)) <= 1e-5, (
            mode,
            losses,
            eager,
        )
    torch._dynamo.reset()
