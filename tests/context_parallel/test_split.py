"""Which tokens each context rank holds, and which tensors handed to a block are cut (no processes)."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.context_parallel import SequenceSplit
from lightning_parallel.context_parallel.split import scatter, scatter_side_inputs, sequence_dim


def test_load_balanced_split_gives_each_rank_a_head_and_a_tail_chunk() -> None:
    split = SequenceSplit(2, 0)
    assert split.positions(8).tolist() == [0, 1, 6, 7]
    assert split.positions(8, rank=1).tolist() == [2, 3, 4, 5]
    assert SequenceSplit(2, 0, load_balanced=False).positions(8).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_every_token_is_held_by_exactly_one_rank_and_the_order_inverts(degree: int) -> None:
    split = SequenceSplit(degree, 0)
    gathered = split.gathered_order(64)
    assert sorted(gathered.tolist()) == list(range(64))
    assert torch.equal(gathered[split.natural_order(64)], torch.arange(64))


def _causal_pairs(split: SequenceSplit, length: int, rank: int) -> int:
    """(query, key) pairs causal attention computes for ``rank``'s queries: its attention FLOPs, up to a constant."""
    return int((split.positions(length, rank=rank) + 1).sum())


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_causal_attention_work_is_equal_on_every_rank_only_with_load_balancing(degree: int) -> None:
    balanced, contiguous = SequenceSplit(degree, 0), SequenceSplit(degree, 0, load_balanced=False)
    work = [_causal_pairs(balanced, 256, r) for r in range(degree)]
    assert len(set(work)) == 1 and sum(work) == 256 * 257 // 2
    naive = [_causal_pairs(contiguous, 256, r) for r in range(degree)]  # the negative control
    assert max(naive) / min(naive) > 2 * degree - 2


def test_a_length_the_split_cannot_cut_evenly_is_a_value_error() -> None:
    with pytest.raises(
        ValueError, match=r"`context_parallel=2` needs a sequence length divisible by 4 .* 30 tokens"
    ):
        SequenceSplit(2, 0).positions(30)
    with pytest.raises(ValueError, match=r"divisible by 3 \(context_parallel\)"):
        SequenceSplit(3, 0, load_balanced=False).check(10)


def test_tensors_handed_to_a_block_are_cut_along_their_sequence_dim_and_masks_stay_whole() -> None:
    length = 8
    assert sequence_dim(torch.zeros(2, length, 16), length) == 1  # hidden, rotary (B, T, D)
    assert sequence_dim(torch.zeros(1, length), length) == 1  # position ids
    assert sequence_dim(torch.zeros(length), length) == 0  # cache_position
    assert sequence_dim(torch.zeros(length, 4), length) == 0  # a (T, D) table
    assert sequence_dim(torch.zeros(2, 1, length, length), length) is None  # a 4-D mask
    assert sequence_dim(torch.zeros(2, 16), length) is None
    split = SequenceSplit(2, 1)
    cos, sin = torch.arange(length).view(1, length, 1).expand(1, length, 3), torch.zeros(1, length, 3)
    args = scatter_side_inputs({"position_embeddings": (cos, sin), "mask": torch.ones(1, 1, length, length)}, split,
                               length)  # fmt: skip
    assert args["position_embeddings"][0][0, :, 0].tolist() == [2, 3, 4, 5]
    assert args["mask"].shape == (1, 1, length, length)


def test_scatter_gradient_puts_each_token_back_at_its_position() -> None:
    x = torch.arange(8.0).view(1, 8).requires_grad_(True)
    scatter(x, SequenceSplit(2, 0), dim=1).sum().backward()
    assert x.grad.tolist() == [[1, 1, 0, 0, 0, 0, 1, 1]]


def _ring_work(degree: int, rank: int, load_balanced: bool) -> int:
    """(query, key) pairs the ring computes for ``rank`` over all hops: the blocks it runs, by their area."""
    from lightning_parallel.context_parallel.blocks import ChunkPairs

    split = SequenceSplit(degree, rank, load_balanced)
    pairs = ChunkPairs(split, 64 * split.num_chunks, is_causal=True, attn_mask=None)
    blocks = [b for source in range(degree) for b in pairs.blocks(source, torch.float32, torch.device("cpu"))]
    size = pairs.chunk_size
    return sum(size * (size + 1) // 2 if b.causal else size * size for b in blocks)


@pytest.mark.parametrize("degree", [2, 4])
def test_the_ring_runs_the_same_causal_work_on_every_rank_only_with_load_balancing(degree: int) -> None:
    balanced = [_ring_work(degree, r, True) for r in range(degree)]
    assert len(set(balanced)) == 1
    contiguous = [_ring_work(degree, r, False) for r in range(degree)]  # the negative control
    assert contiguous == sorted(contiguous) and contiguous[-1] > 2 * contiguous[0]
