"""Context parallelism in the planner: carved out of data parallelism as the strategy carves it, each rank a slice of
every sequence (its compute and activations), the ring's exchanges behind the attention they feed, Ulysses' all-to-alls
in line, the strategy's conditions, and the search trying it where a sequence is long. The memory of a cp2 run against
what its ranks hold: tests/planner/test_memory_exact.py (layout "cp2")."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_parallel.planner.cluster import CLUSTERS
from lightning_parallel.planner.layout import Layout, layout_problems
from lightning_parallel.planner.memory import rank_memory
from lightning_parallel.planner.shapes import ModelShape
from lightning_parallel.planner.timing import step_time

SEQ = 32768
LLAMA_8B = ModelShape.gpt(
    32,
    4096,
    32,
    128256,
    ffn_hidden=14336,
    kv_heads=8,
    gated=True,
    tied_head=False,
    bias=False,
    sequence_length=SEQ,
)


def _layout(cp: int, **changes: object) -> Layout:
    base = Layout(data_parallel=8, context_parallel=cp, zero_stage=3, micro_batch_size=1, sequence_length=SEQ,
                  precision="bf16-mixed", activation_checkpointing="full")  # fmt: skip
    return replace(base, **changes)


def test_each_rank_holds_a_slice_of_every_sequence() -> None:
    assert (_layout(1).global_batch, _layout(1).local_tokens) == (8, SEQ)
    assert (_layout(4).global_batch, _layout(4).local_tokens) == (2, SEQ // 4)
    plain, split = (step_time(LLAMA_8B, _layout(cp), CLUSTERS["h100"]) for cp in (1, 4))
    assert (
        split.compute < plain.compute / 3.5
    )  # a quarter of the tokens (attention still spans the whole sequence)
    # the ring's exchanges hide behind the attention at 32K tokens ...
    assert 0 < split.context_parallel < 0.02 * split.total and plain.context_parallel == 0
    # ... and each cp rank runs the head and the loss on its own tokens (context_parallel/local_tokens.py), so tokens
    # per GPU per second stay within a few percent of one rank's (when the exit ran on the whole sequence on every
    # rank, vocabulary 128,256: 0.89)
    assert 0.97 < split.tokens_per_s / plain.tokens_per_s <= 1.0


def test_the_exchanges_show_where_they_cannot_hide() -> None:
    slow = replace(CLUSTERS["h100"], intra_node_bandwidth=CLUSTERS["h100"].intra_node_bandwidth / 200)
    fast, starved = (step_time(LLAMA_8B, _layout(4), c).context_parallel for c in (CLUSTERS["h100"], slow))
    assert starved > 20 * fast
    ring = step_time(LLAMA_8B, _layout(4), CLUSTERS["h100"])
    ulysses = step_time(LLAMA_8B, _layout(4, context_parallel_mode="ulysses"), CLUSTERS["h100"])
    assert ulysses.context_parallel > ring.context_parallel  # all-to-alls in line, nothing to hide behind


def test_activations_shrink_with_the_slice() -> None:
    """Per rank, a quarter of every activation: the blocks' and the exit's (final norm, head, loss), which the
    runtime computes on each rank's tokens (``context_parallel/local_tokens.py``), with and without recomputation."""
    from recipes.gpt.module import GPTLightningModule

    with torch.device("meta"):
        model = GPTLightningModule(vocab_size=32000, block_size=SEQ, n_layer=8, n_head=8, n_embd=1024)
    for checkpointing in (None, "full"):
        kept = [
            max(
                r.activations for r in rank_memory(model, _layout(cp, activation_checkpointing=checkpointing))
            )
            for cp in (1, 4)
        ]
        assert kept[1] == pytest.approx(kept[0] / 4, rel=1e-3), (checkpointing, kept)


def test_the_strategy_conditions_are_the_planner_problems() -> None:
    assert layout_problems(_layout(2), LLAMA_8B, 8) == []
    assert any(
        "divisible into 6 chunks" in p for p in layout_problems(_layout(3, sequence_length=4096), LLAMA_8B)
    )
    assert any("ulysses" in p for p in layout_problems(_layout(8, context_parallel_mode="ulysses",
                                                                tensor_parallel=8, data_parallel=8), LLAMA_8B))  # fmt: skip
    assert any(
        "context_parallel=3" in p
        for p in layout_problems(_layout(3, sequence_length=3 * 4096 * 2), LLAMA_8B, 8)
    )  # 3 does not divide the 8 data-parallel ranks: the strategy's own refusal
