"""Magnitude pruning under every layout reproduces the one-process pruned run.

One process computes the same global threshold on the whole model as the shards' collectives do,
so the masks, the losses and every final weight must match (fp32, the project's 1e-5). Each case
asserts that pruning engaged (the pruned count, zeros in the weights) and the threshold equals the
reference's; a per-shard threshold (``tests/compression/controls.py``) is the negative control.
"""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.compression import MagnitudePruning, PruningSchedule, kth_smallest_magnitude
from lightning_parallel.precision.layout_sum import LayoutSum
from tests.distributed.cases import Case, StrategySpec, hybrid
from tests.distributed.harness import Result, assert_parity, reference, run_cases

LINEAR_WEIGHTS = (
    "c_attn.weight",
    "c_proj.weight",
    "c_fc.weight",
)  # nanoGPT's; its head is tied to the embedding
ONE_SHOT = {"amount": 0.5}  # before the first step: the weights are rank 0's initial ones on every layout


def _pruning(
    target: str = "lightning_parallel.compression:MagnitudePruning", **kwargs: object
) -> StrategySpec:
    return StrategySpec(target, {**ONE_SHOT, **kwargs})


def _case(name: str, world_size: int = 2, callback: StrategySpec | None = None, family: str = "nanogpt",
          **kwargs: object) -> Case:  # fmt: skip
    case = hybrid(name, family, world_size=world_size, timeout=60, **kwargs)
    return case.replace(callbacks=(callback or _pruning(),))


CASES = [
    _case("prune_dp2_nanogpt"),
    _case("prune_tp2_nanogpt", tensor_parallel=2),
    _case("prune_pp2_nanogpt", pipeline_parallel=2, micro_batches=2),
    # Gradual (events after steps 1, 2, 3): data parallelism keeps the weights bitwise equal to one process's.
    _case("prune_gradual_dp2_nanogpt", callback=_pruning(every_n_steps=1, end_step=3)),
    _case("prune24_tp2_nanogpt", tensor_parallel=2, callback=_pruning(pattern="2:4", amount=0.5)),
]
CHANNELS = "lightning_parallel.compression.channels:ChannelPruning"
# Whole MLP channels: rows of the up projection and columns of the down one, cut alike by tensor parallelism.
CHANNEL_CASES = [
    _case("prune_channels_tp2_nanogpt", tensor_parallel=2, callback=_pruning(CHANNELS)),
    _case("prune_channels_pp2_nanogpt", pipeline_parallel=2, micro_batches=2, callback=_pruning(CHANNELS)),
    _case(
        "prune_channels_tp2_hf_llama", family="hf_llama", tensor_parallel=2, callback=_pruning(CHANNELS)
    ),  # gated
]
# ZeRO on FSDP2: masks on the dp shards of DTensor weights; at stage 2 the whole weights are gathered
# again after each step, after the masks were applied (the optimizer's post-step hook).
FOUR = [
    _case("prune_zero3_tp2_dp2_nanogpt", 4, zero_stage=3, tensor_parallel=2),
    _case("prune_zero2_pp2_dp2_nanogpt", 4, zero_stage=2, pipeline_parallel=2, micro_batches=2),
]
CONTROL = _case("prune_shardlocal_tp2_nanogpt", tensor_parallel=2,
                callback=_pruning("tests.compression.controls:ShardLocalPruning"))  # fmt: skip


@pytest.fixture(scope="module")
def results(two_process_compression: dict[str, Result]) -> dict[str, Result]:
    return two_process_compression  # tests/compression/conftest.py: with the other file's cases, one launch


@pytest.fixture(scope="module")
def four_process() -> dict[str, Result]:
    return run_cases(FOUR, 4, timeout_s=600, references_for=FOUR)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pruned_training_matches_the_one_process_pruned_run(results: dict[str, Result], case: Case) -> None:
    _check(results[case.name], reference(case))


@pytest.mark.distributed
@pytest.mark.parametrize("case", FOUR, ids=lambda c: c.name)
def test_pruning_under_zero_matches_the_one_process_pruned_run(
    four_process: dict[str, Result], case: Case
) -> None:
    _check(four_process[case.name], reference(case))


def _check(result: Result, ref: Result) -> None:
    assert_parity(result, ref)
    facts, want = result.facts, ref.facts
    assert facts["selected"] == want["selected"] > 0
    assert facts["pruned"] == want["pruned"] >= 0.49 * want["selected"], (
        "pruning engaged, to the schedule's 50%"
    )
    if want["threshold"] is not None:
        assert facts["threshold"] == pytest.approx(want["threshold"], rel=1e-5)
    linear = [t for name, t in result.params.items() if name.endswith(LINEAR_WEIGHTS)]
    assert sum(int((t == 0).sum()) for t in linear) == facts["pruned"], "the masks held through the last step"


@pytest.mark.distributed
@pytest.mark.parametrize("case", CHANNEL_CASES, ids=lambda c: c.name)
def test_channel_pruning_matches_the_one_process_run(results: dict[str, Result], case: Case) -> None:
    result, ref = results[case.name], reference(case)
    assert_parity(result, ref)
    assert result.facts["pruned"] == ref.facts["pruned"] == result.facts["selected"] // 2 > 0
    ups = [t for name, t in result.params.items() if name.endswith(("mlp.c_fc.weight", "mlp.up_proj.weight"))]
    downs = [
        t for name, t in result.params.items() if name.endswith(("mlp.c_proj.weight", "mlp.down_proj.weight"))
    ]
    zero_rows = sum(int((up == 0).all(1).sum()) for up in ups)
    zero_columns = sum(int((down == 0).all(0).sum()) for down in downs)
    assert zero_rows == zero_columns == result.facts["pruned"], "whole channels, both projections"


@pytest.mark.distributed
def test_two_four_keeps_two_of_every_four_weights(results: dict[str, Result]) -> None:
    weight = results["prune24_tp2_nanogpt"].params["model.transformer.h.0.mlp.c_fc.weight"]
    assert ((weight.reshape(-1, 4) != 0).sum(1) <= 2).all()


@pytest.mark.distributed
def test_a_per_shard_threshold_fails_the_parity_negative_control(results: dict[str, Result]) -> None:
    with pytest.raises(AssertionError, match="does not match"):
        assert_parity(results[CONTROL.name], reference(CONTROL))


def test_the_threshold_is_the_kth_smallest_magnitude() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(7, 5), torch.randn(3, 16)]
    magnitudes = [w.abs() for w in weights]
    for k in (1, 17, 60, 83):
        want = torch.cat([m.flatten() for m in magnitudes]).kthvalue(k).values
        assert kth_smallest_magnitude(magnitudes, LayoutSum(weights), k) == float(want)


def test_the_gradual_schedule_reaches_its_amount_in_cubic_steps() -> None:
    schedule = PruningSchedule(0.8, start_step=2, every_n_steps=2, end_step=8)
    got = [schedule.sparsity_at(s) for s in range(10)]
    assert got[:2] == [None, None] and got[3] is None and got[9] is None and got[2] == 0.0
    assert got[4] == pytest.approx(0.8 * (1 - (2 / 3) ** 3)) and got[8] == pytest.approx(0.8)
    assert PruningSchedule(0.5).sparsity_at(0) == 0.5 and PruningSchedule(0.5).sparsity_at(1) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [({"amount": 1.0}, "amount=1.0"), ({"amount": -0.1}, "amount=-0.1"), ({"pattern": "2:4", "amount": 0.7}, "amount=0.5"),
     ({"pattern": "4:8"}, "pattern='4:8'"), ({"every_n_steps": 0}, "every_n_steps=0"), ({"start_step": 2, "end_step": 1}, "end_step=1"),
     ({"every_n_steps": 2, "end_step": 3}, "end_step=3")],
)  # fmt: skip
def test_bad_arguments_fail_with_the_argument_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        MagnitudePruning(**kwargs)


def test_channel_pruning_refuses_zero_at_the_start_of_training() -> None:
    from types import SimpleNamespace

    from lightning_parallel.compression.channels import ChannelPruning

    strategy = SimpleNamespace(config=SimpleNamespace(zero=SimpleNamespace(enabled=True)))
    with pytest.raises(ValueError, match="zero_stage"):
        ChannelPruning(0.5).on_train_start(SimpleNamespace(strategy=strategy), torch.nn.Linear(2, 2))  # type: ignore[arg-type]
