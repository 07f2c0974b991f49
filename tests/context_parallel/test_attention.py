"""Ring and all-to-all attention equal torch's attention over the whole sequence, outputs and gradients.

On 2 and 4 gloo ranks: causal and not, grouped KV heads (``enable_gqa``; in Ulysses repeated when the
KV heads do not divide the ranks), boolean and additive masks computed for the whole sequence (also
with grouped heads, and with a query row that may attend to nothing), load-balanced and contiguous
splits, torch's fused CPU kernel and the math blocks. The bytes each mode sends are held against their theory
(the ring: ``C - 1`` hops of this rank's keys and values forward, ``C - 1`` of keys and values
and ``C`` of their fp32 gradients backward; the all-to-all: ``(C - 1) / C`` of q, k, v and the
output, in each direction). Negative control: attention over each rank's own tokens, what the
model would compute without the routing, misses the reference.
"""

from __future__ import annotations

import pytest

from tests.context_parallel import attention_workers
from tests.experts.spawn import run_ranks

pytestmark = [pytest.mark.distributed]

SETTINGS = [  # (mode, kv_heads, causal, masked, load_balanced)
    ("ring", 4, True, False, True),
    ("ring", 2, True, False, True),
    ("ring", 4, False, True, True),
    ("ring", 2, True, False, False),
    ("ring", 2, False, True, True),  # grouped KV heads with a mask
    ("ring", 4, False, "additive", True),  # an additive (float) mask
    ("ring", 4, False, "empty_row", True),  # a query row with no key: output 0, finite gradients (as torch)
    ("ulysses", 2, False, "additive", True),
    ("ulysses", 4, False, "empty_row", True),
    ("ring", 4, False, "empty_row", True, False, False),
    ("ring", 2, True, False, True, False, False),  # the math blocks other devices run
    ("ring", 4, False, True, True, False, False),
    ("ulysses", 4, True, False, True),
    ("ulysses", 2, True, False, True),
    ("ulysses", 4, False, True, False),
]


BYTES = [("ring", 4), ("ring", 2), ("ulysses", 4), ("ulysses", 2)]
CONTROLS = [("ring", 4, True, False, True, True), ("ulysses", 4, True, False, True, True)]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def outcomes(request: pytest.FixtureRequest) -> tuple[int, dict[tuple, list[dict[str, float]]]]:
    """Every setting on ``world_size`` ranks, in one launch: setting -> outcome per rank."""
    settings = [*SETTINGS, *[(mode, kv, True, False, True) for mode, kv in BYTES], *CONTROLS]
    per_rank = run_ranks(attention_workers.compare_all, request.param, (settings,), timeout_s=240)
    return request.param, {s: [rank[i] for rank in per_rank] for i, s in enumerate(settings)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s)))
def test_split_attention_equals_whole_sequence_attention(outcomes: tuple, setting: tuple) -> None:
    _, by_setting = outcomes
    for rank, outcome in enumerate(by_setting[setting]):
        assert outcome["close"] == 1.0, f"rank {rank}: {outcome}"


def _bytes(world_size: int, mode: str, kv_heads: int) -> float:
    """What one rank sends for one attention call, forward and backward (fp32)."""
    shapes = attention_workers.SHAPES
    local = shapes["batch"] * shapes["length"] // world_size * shapes["dim"] * 4  # bytes per head
    if mode == "ring":
        kv = 2 * kv_heads * local
        return (world_size - 1) * kv + (world_size - 1) * kv + world_size * kv  # fwd kv, bwd kv, bwd dk/dv
    heads, kv_heads = shapes["heads"], kv_heads if kv_heads % world_size == 0 else shapes["heads"]
    share = (world_size - 1) / world_size
    return 2 * share * local * (heads + 2 * kv_heads + heads)  # q, k, v, out; forward and backward


def _whole_output_bytes() -> int:
    shapes = attention_workers.SHAPES
    return shapes["batch"] * shapes["heads"] * shapes["length"] * shapes["dim"] * 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "kv_heads"), BYTES)
def test_bytes_sent_match_theory(outcomes: tuple, mode: str, kv_heads: int) -> None:
    world_size, by_setting = outcomes
    outcome = by_setting[(mode, kv_heads, True, False, True)][0]
    kind = "ring" if mode == "ring" else "all_to_all"
    assert outcome[f"{kind}_bytes"] == _bytes(world_size, mode, kv_heads), outcome
    # The test's own gather of the output: this rank's share, to each of the others.
    assert outcome["all_gather_bytes"] == _whole_output_bytes() * (world_size - 1) / world_size, outcome


@pytest.mark.timeout(300)
@pytest.mark.parametrize("control", CONTROLS, ids=lambda s: s[0])
def test_attention_over_each_ranks_own_tokens_misses_the_reference(outcomes: tuple, control: tuple) -> None:
    """The negative control: without routing, a split sequence attends to its own chunk only."""
    _, by_setting = outcomes
    assert all(o["close"] == 0.0 for o in by_setting[control]), by_setting[control]
    assert max(o["out"] for o in by_setting[control]) > 1e-2, by_setting[control]
