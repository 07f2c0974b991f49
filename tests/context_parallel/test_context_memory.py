"""Activation bytes held for backward per rank fall as 1/C, inside the block stack and after it, counted by part.

Measured through the real Trainer on 4 ranks (``tests/strategy/scripts/context_memory.py``): the
recipe GPT (width E=32, 4 heads) on B=2 sequences of T=64 tokens per data replica, with
``context_parallel`` = 1, 2, 4, at 2 and 4 blocks, by the saved-tensor hooks. Per part:

- one block (the difference of the two depths, halved): ring attention holds exactly ``1/C`` of
  the one-process block (its queries, keys, values, output and log-sum-exp, like the flash
  kernel it replaces, for this rank's tokens); Ulysses holds ``1/C`` plus its output in sequence
  layout beside the kernel's in head layout (``B x T/C x E`` fp32) plus its two int64 orders of
  the whole sequence (``8T`` bytes each: into sequence order, shared by q, k and v, and back);
- outside the stack (the rest): the embedding's indices as one process keeps them (``8BT`` and ``8T``
  bytes: the embedding runs before the split), this rank's positions entering the split (``8T/C``),
  and ``1/C`` of one process's exit: the final norm, the head and the loss's fp32 log-probabilities
  and targets run on this rank's tokens (``context_parallel/local_tokens.py``), with the loss's two
  scalars (its fp32 total weight, and the int64 count of targets its mean divides by).

Both bounds are also the negative controls: a layout that did not split the sequence would hold ``C``
times what they allow in the blocks, and the exit gathered whole after the stack (as before the
follower) would hold one process's exit outside it.
"""

from __future__ import annotations

import json

import pytest

from tests.strategy import launch

pytestmark = [pytest.mark.distributed]
B, T, E, F32, INT64 = 2, 64, 32, 4, 8
EMBEDDING = INT64 * B * T + INT64 * T  # the token and position embeddings' indices


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("context_memory")
    launch(
        "context_memory.py", [str(out)], out, world_size=4, timeout_s=500, grace_s=30
    ).assert_all_succeeded()
    return [json.loads((out / f"context_memory.rank{r}.json").read_text()) for r in range(4)]


def _parts(run: dict, layout: str) -> tuple[int, int]:
    """(bytes of one block, bytes outside the stack) of a layout, from its two depths."""
    two, four = run[f"{layout}_layers2"], run[f"{layout}_layers4"]
    block = (four - two) // 2
    return block, two - 2 * block


@pytest.mark.timeout(600)
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_block_and_exit_activations_fall_as_one_over_c(measured: list[dict], mode: str, degree: int) -> None:
    for rank, run in enumerate(measured):
        assert (run["batch"], run["length"]) == (B, T)
        block_1, outside_1 = _parts(run, "cp1_ring")
        block, outside = _parts(run, f"cp{degree}_{mode}")
        expected = block_1 // degree
        if mode == "ulysses":
            expected += B * (T // degree) * E * F32 + 2 * INT64 * T
        print(f"rank {rank} cp{degree} {mode}: block {block} (cp1 {block_1}, {block / block_1:.3f}),"
              f" outside {outside} (cp1 {outside_1})")  # fmt: skip
        assert block == expected, f"rank {rank}: one block holds {block} bytes, expected {expected}"
        exit_1 = (
            outside_1 - EMBEDDING - F32
        )  # one process's final norm, head and loss, its total weight aside
        expected_outside = EMBEDDING + INT64 * T // degree + exit_1 // degree + F32 + INT64
        assert outside == expected_outside, f"rank {rank}: {outside} outside vs {outside_1} in one process"
