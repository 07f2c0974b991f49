"""Routing maths as pure functions: top-k and ties, capacity, queue priority, global offsets, losses."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_parallel.experts.layer import plan_queues
from lightning_parallel.experts.router import (
    assignment_counts,
    expert_capacity,
    global_queue_offsets,
    load_balancing_loss,
    queue_positions,
    route_topk,
    router_z_loss,
)


def test_topk_picks_most_probable_and_breaks_ties_towards_lower_ids() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0], [3.0, 3.0, -1.0, 3.0]])
    routing = route_topk(logits, top_k=2)
    assert routing.experts_NK.tolist() == [[1, 3], [0, 1], [0, 1]]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(routing.weights_NK, probs.gather(1, routing.experts_NK))
    torch.testing.assert_close(routing.probs_NE, probs)
    # the same logits route the same way every time (no dependence on topk's internal order)
    for _ in range(3):
        assert torch.equal(route_topk(logits, 2).experts_NK, routing.experts_NK)


def test_topk_normalize_and_bounds() -> None:
    logits = torch.randn(5, 4)
    weights = route_topk(logits, 2, normalize=True).weights_NK
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    assert route_topk(logits, 4).experts_NK.shape == (5, 4)
    with pytest.raises(ValueError, match="top_k=5"):
        route_topk(logits, 5)
    with pytest.raises(ValueError, match="top_k=0"):
        route_topk(logits, 0)


def test_capacity_is_exact_ceil() -> None:
    assert expert_capacity(8, 4, 1, 1.0) == 2
    assert expert_capacity(10, 4, 1, 1.0) == 3  # 2.5 -> 3
    assert expert_capacity(8, 4, 2, 1.25) == 5  # 2 * 8 / 4 * 1.25 = 5 exactly
    assert expert_capacity(100, 1, 1, 1.1) == 110  # in floats 100 / 1 * 1.1 = 110.00000000000001
    assert math.ceil(1 * 100 / 1 * 1.1) == 111
    with pytest.raises(ValueError, match="capacity_factor=0"):
        expert_capacity(8, 4, 1, 0)
    with pytest.raises(ValueError, match="capacity_factor=-1"):
        expert_capacity(8, 4, 1, -1)


def test_queue_positions_first_choices_before_second_choices_then_token_order() -> None:
    experts = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 1]])  # (N=4, K=2)
    positions = queue_positions(experts, num_experts=4)
    # expert 0: first choices of tokens 0, 2, 3 -> 0, 1, 2; then second choice of token 1 -> 3
    # expert 1: first choice of token 1 -> 0; second choices of tokens 0, 3 -> 1, 2
    # expert 2: second choice of token 2 -> 0; expert 3: no token at all
    assert positions.tolist() == [[0, 1], [0, 3], [1, 0], [2, 2]]


def test_all_tokens_to_one_expert_and_zero_tokens_elsewhere() -> None:
    experts = torch.zeros(6, 1, dtype=torch.long)
    assert queue_positions(experts, 3).squeeze(1).tolist() == list(range(6))
    queues = plan_queues(experts, num_experts=3, num_samples=6, capacity_factor=1.0)
    assert queues.tokens_per_expert_E.tolist() == [6, 0, 0]
    # capacity ceil(6 / 3 * 1.0) = 2: the first two tokens kept, in token order
    assert queues.keep_NK.squeeze(1).tolist() == [True, True, False, False, False, False]
    assert float(queues.dropped) == pytest.approx(4 / 6)


def test_capacity_overflow_drops_second_choices_first() -> None:
    # expert 0: first choices of tokens 0, 1, 3, then the second choice of token 2
    # expert 1: first choice of token 2, then the second choices of tokens 0, 1, 3
    experts = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])
    queues = plan_queues(experts, num_experts=2, num_samples=4, capacity_factor=0.75)  # capacity 3
    assert queues.keep_NK.tolist() == [[True, True], [True, True], [True, False], [True, False]]
    assert float(queues.dropped) == pytest.approx(2 / 8)
    dropless = plan_queues(experts, num_experts=2, num_samples=4, capacity_factor=None)
    assert dropless.keep_NK is None and float(dropless.dropped) == 0.0


@pytest.mark.parametrize("order", ["sample_interleaved", "rank_major"])
def test_global_offsets_equal_one_queue_over_the_whole_batch(order: str) -> None:
    """Local position + offset == position in ONE queue over the global batch (brute force)."""
    ranks, samples, seq, top_k, num_experts = 3, 2, 5, 2, 4
    gen = torch.Generator().manual_seed(0)
    local = [torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(samples * seq)])
             for _ in range(ranks)]  # fmt: skip
    counts = torch.stack([assignment_counts(e, num_experts, samples) for e in local])
    if order == "rank_major":
        global_batch = torch.cat(local)
    else:  # global sample b * R + r is local sample b of rank r
        global_batch = torch.stack([e.view(samples, seq, top_k) for e in local], 1).reshape(-1, top_k)
    want = queue_positions(global_batch, num_experts)
    for rank, experts in enumerate(local):
        offsets = global_queue_offsets(counts, rank, order)
        sample = torch.arange(samples * seq) // seq
        got = (
            queue_positions(experts, num_experts)
            + offsets[torch.arange(top_k)[None], sample[:, None], experts]
        )
        if order == "rank_major":
            expected = want.view(ranks, samples * seq, top_k)[rank]
        else:
            expected = want.view(samples, ranks, seq, top_k)[:, rank].reshape(-1, top_k)
        assert torch.equal(got, expected), rank


def test_load_balancing_loss_values_and_replica_scaling() -> None:
    num_experts, top_k = 4, 2
    uniform = torch.full((8, num_experts), 1 / num_experts)
    counts = torch.full((num_experts,), 8 * top_k / num_experts)
    assert float(load_balancing_loss(uniform, counts, 8, top_k)) == pytest.approx(1.0)
    collapsed = torch.zeros(8, num_experts)
    collapsed[:, 0] = 1.0
    one_expert = torch.tensor([8.0, 0, 0, 0])
    assert float(load_balancing_loss(collapsed, one_expert, 8, 1)) == pytest.approx(num_experts)
    # two ranks: mean of the scaled per-rank losses == the loss of the whole batch
    probs = torch.softmax(torch.randn(10, num_experts), -1)
    experts = route_topk(probs.log(), top_k).experts_NK
    total_counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    whole = load_balancing_loss(probs, total_counts, 10, top_k)
    halves = [load_balancing_loss(p, total_counts, 10, top_k, replicas=2) for p in probs.chunk(2)]
    torch.testing.assert_close((halves[0] + halves[1]) / 2, whole)


def test_router_z_loss() -> None:
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    want = (math.log(2) ** 2 + (1 + math.log(2)) ** 2) / 2
    assert float(router_z_loss(logits)) == pytest.approx(want)
    halves = [router_z_loss(chunk, total_tokens=2, replicas=2) for chunk in logits.chunk(2)]
    assert float((halves[0] + halves[1]) / 2) == pytest.approx(want)
