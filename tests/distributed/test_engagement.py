"""Every row of the compatibility matrix has an engagement check, and a record without the feature fails it."""

from __future__ import annotations

import pytest

from tests.compat import ROWS
from tests.distributed.engagement import CHECKS, engagement_problems, merge_records

FP32_DDP = {"parameter_dtypes": ["torch.float32"], "autocast_linears": 0}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_record_without_the_feature_fails_its_row(row: str) -> None:
    """Negative control of every check: the feature switched off (nothing in the record) is caught."""
    assert engagement_problems(frozenset({row}), {}, {}), row


def test_every_matrix_row_has_a_check() -> None:
    assert set(ROWS) <= set(CHECKS)


def test_a_record_showing_the_features_passes() -> None:
    collectives = {
        "dp.allreduce_": 4,
        "dp.reduce_scatter_tensor": 4,
        "dp.all_gather_into_tensor": 8,
        "tp.all_reduce": 16,
        "pp.send": 8,
        "pp.recv_": 8,
    }
    record = merge_records([
        {**FP32_DDP, "tp_sharded_parameters": 3, "zero_stage": 3, "zero_engine": "fsdp2", "dp_sharded_parameters": 5,
         "collectives": collectives, "optimizer_steps": 4},
        {**FP32_DDP, "tp_sharded_parameters": 3, "schedule": "ScheduleZBVZeroBubble", "checkpointed_modules": 2,
         "collectives": {"tp.all_reduce": 20}, "optimizer_steps": 4},
    ])  # fmt: skip
    rows = frozenset({"dp", "tp", "zero3", "pp=zbv", "ac=full", "32-true"})
    assert engagement_problems(rows, record, {"data_parallel": 2}) == []
    assert record["zero_stage"] == 3 and record["tp_sharded_parameters"] == 6  # stages kept, counts summed
    assert engagement_problems(frozenset({"pp=gpipe"}), record, {})  # another schedule ran
    assert record["collectives"]["tp.all_reduce"] == 20  # the busiest rank's count


@pytest.mark.parametrize(
    ("row", "missing"),
    [("dp", "dp.allreduce_"), ("tp", "tp.all_reduce"), ("pp=1f1b", "pp.send"), ("ep", "ep.alltoall_base_"),
     ("zero3", "dp.all_gather_into_tensor"), ("sp", "tp.all_gather_into_tensor"), ("cp", "cp.send")],
)  # fmt: skip
def test_a_feature_whose_collectives_never_ran_fails_its_row(row: str, missing: str) -> None:
    """Negative control: the record shows the feature set up, but its group carried nothing per step."""
    base = {**FP32_DDP, "tp_sharded_parameters": 2, "dp_sharded_parameters": 2, "zero_stage": 3,
            "zero_engine": "fsdp2", "schedule": "Schedule1F1B", "expert_parameters": 2,
            "sequence_sharded_norm_inputs": 2, "optimizer_steps": 4}  # fmt: skip
    facts = {"data_parallel": 2, "context_calls": 4}
    assert engagement_problems(frozenset({row}), {**base, "collectives": {missing: 4}}, facts) == []
    problems = engagement_problems(frozenset({row}), {**base, "collectives": {missing: 3}}, facts)
    assert problems and "per optimizer step" in problems[0]  # fewer than one per step
    assert engagement_problems(frozenset({row}), {**base, "collectives": {}}, facts)


def test_a_data_parallel_reduction_in_two_stages_over_the_factors_of_dp_counts() -> None:
    """dp = dp_replicate x ep reduced over ep, then over dp_replicate (ZeRO under expert parallelism)."""
    record = {"optimizer_steps": 4, "collectives": {"ep.allreduce_": 8, "dp_replicate.allreduce_": 4}}
    assert engagement_problems(frozenset({"dp"}), record, {"data_parallel": 4}) == []
    record["collectives"].pop("dp_replicate.allreduce_")  # one factor only: half of dp never averaged
    assert engagement_problems(frozenset({"dp"}), record, {"data_parallel": 4})


@pytest.mark.parametrize("row", ["zero1", "zero2", "zero3"])
def test_a_deepspeed_engine_that_partitioned_nothing_fails_its_zero_row(row: str) -> None:
    """Negative control: the engine ran at the stage, but each rank's optimizer held every element."""
    record = {"zero_engine": "deepspeed", "zero_stage": int(row[-1]), "parameter_numel": 1000,
              "optimizer_steps": 4, "collectives": {"dp.allreduce_": 4, "dp._allgather_base_": 4}}  # fmt: skip
    assert engagement_problems(frozenset({row}), {**record, "zero_partition_numel": 500}, {}) == []
    assert engagement_problems(frozenset({row}), {**record, "zero_partition_numel": 1000}, {})
