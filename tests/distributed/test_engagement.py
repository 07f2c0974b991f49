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


def test_every_matrix_row_but_fp16_autocast_has_a_check() -> None:
    # 16-mixed (fp16 autocast needs a GPU; the CPU runs it as bf16-mixed) is never run by a parity case here.
    assert set(ROWS) - set(CHECKS) <= {"16-mixed"}


def test_a_record_showing_the_features_passes() -> None:
    record = merge_records([
        {**FP32_DDP, "tp_sharded_parameters": 3, "zero_stage": 3, "zero_engine": "fsdp2", "dp_sharded_parameters": 5},
        {**FP32_DDP, "tp_sharded_parameters": 3, "schedule": "ScheduleZBVZeroBubble", "checkpointed_modules": 2},
    ])  # fmt: skip
    rows = frozenset({"dp", "tp", "zero3", "pp=zbv", "ac=full", "32-true"})
    assert engagement_problems(rows, record, {"data_parallel": 2}) == []
    assert record["zero_stage"] == 3 and record["tp_sharded_parameters"] == 6  # stages kept, counts summed
    assert engagement_problems(frozenset({"pp=gpipe"}), record, {})  # another schedule ran
