"""Every row of the compatibility matrix has an engagement check, and a record without the feature fails it."""

from __future__ import annotations

import pytest

from tests.compat import ROWS
from tests.distributed.engagement import CHECKS, engagement_problems, merge_records

FP32_DDP = {"parameter_dtypes": ["torch.float32"], "autocast_linears": 0}
TP_BLOCKS = {"tp_blocks": ["h.0", "h.1"], "tp_sharded_blocks": ["h.0", "h.1"], "tp_block_matrix_numel": 100,
             "tp_block_matrix_sharded_numel": 90}  # fmt: skip
SHARDED_STATES = {"state_numel": 100, "state_dp_sharded_numel": 96}


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
        {**FP32_DDP, **TP_BLOCKS, "tp_sharded_parameters": 3, "zero_stage": 3, "zero_engine": "fsdp2",
         "dp_sharded_parameters": 5, "collectives": collectives, "optimizer_steps": 4, **SHARDED_STATES},
        {**FP32_DDP, **TP_BLOCKS, "tp_sharded_parameters": 3, "schedule": "ScheduleZBVZeroBubble",
         "checkpointed_modules": 2, "recomputed_ops": 40, "recomputed_matmuls": 8,
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
    base = {**FP32_DDP, **TP_BLOCKS, **SHARDED_STATES, "tp_sharded_parameters": 2, "dp_sharded_parameters": 2,
            "zero_stage": 3, "zero_engine": "fsdp2", "schedule": "Schedule1F1B", "expert_parameters": 2,
            "sequence_sharded_norm_inputs": 2, "optimizer_steps": 4}  # fmt: skip
    facts = {"data_parallel": 2, "context_calls": 4}
    scatters = {"dp._reduce_scatter_base_": 4} if row == "zero3" else {}  # FSDP2's gradients, present here
    assert (
        engagement_problems(frozenset({row}), {**base, "collectives": {missing: 4, **scatters}}, facts) == []
    )
    problems = engagement_problems(frozenset({row}), {**base, "collectives": {missing: 3, **scatters}}, facts)
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


@pytest.mark.parametrize(
    ("change", "why"),
    [({"tp_sharded_blocks": ["h.0"]}, "blocks left whole"),
     ({"tp_sharded_blocks": [], "tp_block_matrix_sharded_numel": 0}, "no weight of the block stack"),
     ({"tp_block_matrix_sharded_numel": 40}, "40 of the block stack's 100")],
)  # fmt: skip
def test_tensor_parallelism_that_left_blocks_whole_fails_its_row(change: dict, why: str) -> None:
    """Negative control: one sharded parameter is not tensor parallelism; every block, and most of its weights."""
    record = {
        **TP_BLOCKS,
        "tp_sharded_parameters": 1,
        "optimizer_steps": 4,
        "collectives": {"tp.all_reduce": 8},
    }
    assert engagement_problems(frozenset({"tp"}), record, {}) == []
    problems = engagement_problems(frozenset({"tp"}), {**record, **change}, {})
    assert problems and why in problems[0], problems


@pytest.mark.parametrize(
    ("ran", "asked", "ok"),
    [("full", "ac=full", True), ("ops", "ac=selective", True), ("full", "ac=selective", False),
     ("ops", "ac=full", False), ("nothing", "ac=selective", False)],
)  # fmt: skip
def test_full_and_selective_recomputation_are_told_apart(ran: str, asked: str, ok: bool) -> None:
    """What backward ran again: full recomputation reruns the matmuls, op-level selective only cheap ops."""
    recomputed = {"full": (120, 16), "ops": (60, 0), "nothing": (0, 0)}[ran]
    record = {"checkpointed_modules": 4, "recomputed_ops": recomputed[0], "recomputed_matmuls": recomputed[1],
              "recompute_policy": "ops" if asked == "ac=selective" else "full"}  # fmt: skip
    assert (engagement_problems(frozenset({asked}), record, {}) == []) is ok


def test_selective_recomputation_by_blocks_reruns_their_matmuls() -> None:
    """``activation_checkpointing_policy=2`` (every second block recomputed fully): matmuls run again."""
    record = {
        "checkpointed_modules": 2,
        "recomputed_ops": 60,
        "recomputed_matmuls": 8,
        "recompute_policy": "selective",
    }
    assert engagement_problems(frozenset({"ac=selective"}), record, {}) == []
    assert engagement_problems(frozenset({"ac=selective"}), {**record, "recomputed_matmuls": 0}, {})


HOST = {"offload": "cpu", "host_optimizer": "DeepSpeedCPUAdam", "host_state_bytes": 4096,
        "host_state_devices": ["cpu"], "host_steps": 4, "optimizer_steps": 4}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [{"host_optimizer": None}, {"host_state_bytes": 0}, {"host_state_devices": ["cuda"]}, {"host_steps": 0}],
)
def test_cpu_offload_is_proven_by_where_the_states_live_and_who_steps_them(change: dict) -> None:
    """Negative control: the flag says cpu, but no host optimizer, no host bytes, states on the device, or
    a host optimizer that never stepped."""
    assert engagement_problems(frozenset({"offload=cpu"}), HOST, {}) == []
    assert engagement_problems(frozenset({"offload=cpu"}), {**HOST, **change}, {})


@pytest.mark.parametrize(
    "change",
    [{"collectives": {"dp._allgather_base_": 8}}, {"state_dp_sharded_numel": 0}, {"state_numel": 0}],
)
def test_zero2_on_fsdp2_is_proven_by_reduce_scatters_and_sharded_states(change: dict) -> None:
    """Negative control: FSDP2 present at stage 2, but no reduce-scatter per step, or optimizer states whole."""
    record = {"zero_engine": "fsdp2", "zero_stage": 2, "optimizer_steps": 4, **SHARDED_STATES,
              "collectives": {"dp._reduce_scatter_base_": 12, "dp._allgather_base_": 8}}  # fmt: skip
    assert engagement_problems(frozenset({"zero2"}), record, {}) == []
    assert engagement_problems(frozenset({"zero2"}), {**record, **change}, {})


@pytest.mark.parametrize(
    ("record", "ok"),
    [
        ({"sequence_sharded_norm_inputs": 4}, True),
        # norms without weights (OLMo's) run on plain local slices: the exits' reduce-scatters prove the split
        ({"weightless_norms": 1, "collectives": {"tp.reduce_scatter_tensor": 8}}, True),
        ({"weightless_norms": 1, "collectives": {"tp.allreduce_": 8}}, False),  # tensor parallelism alone
        ({"weightless_norms": 0, "collectives": {"tp.reduce_scatter_tensor": 8}}, False),  # norms left whole
        # a model without norms: the exits' reduce-scatters again
        ({"norms": 0, "collectives": {"tp.reduce_scatter_tensor": 8}}, True),
        ({"norms": 0, "collectives": {"tp.allreduce_": 8}}, False),
    ],
)
def test_sequence_parallelism_is_proven_by_sharded_norm_inputs_or_weightless_norms_scatters(
    record: dict, ok: bool
) -> None:
    assert (CHECKS["sp"](record, {}) is None) == ok, record
