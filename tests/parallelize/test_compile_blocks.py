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
