"""The pipeline benchmarks run end to end on a tiny GPT, and activation memory has the schedules' structure.

Efficiency is timed, so it is only checked to be a sane number here (never a timed
assertion: the machine may be loaded). Activation memory is *counted* bytes, identical on
every run, so its structure is asserted exactly: with P=2 pipeline ranks and M micro-batches,
1F1B holds at most P - s micro-batches' activations on stage s, GPipe holds all M.
"""

from __future__ import annotations

import math

import pytest

from benchmarks import pipeline_efficiency, pipeline_memory

P = pipeline_efficiency.PIPELINE_PARALLEL
M = 4


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_efficiency_runs_and_reports_sane_numbers() -> None:
    # dualpipev needs M >= 2P = 4: at M=2 it is reported as skipped, without a launch of its own.
    payload = pipeline_efficiency.measure(
        ("1f1b", "dualpipev"),
        (2,),
        shape="tiny",
        steps=2,
        warmup=1,
        micro_batch_size=1,
        timeout_s=280,
        hand=True,
    )
    measured, skipped = payload["rows"]
    assert measured["schedule"] == "1f1b" and measured["micro_batches"] == 2 and measured["batch"] == 2
    assert measured["ideal"] == pytest.approx(2 / 3)  # M / (M + P - 1)
    assert measured["pairs"] == 2
    assert measured["reference_s"] > 0 and measured["pipelined_s"] > 0
    # Efficiency is reference / (P x pipelined): a positive, finite ratio of timings, reported, never
    # bounded here (a timed assertion fails on a loaded machine); the median lies between its quartiles.
    assert math.isfinite(measured["efficiency"]) and measured["efficiency"] > 0
    assert measured["q1"] <= measured["efficiency"] <= measured["q3"]
    # CPU seconds of the reference / of both ranks together: also a positive, finite ratio.
    assert math.isfinite(measured["work"]) and measured["work"] > 0
    # --hand: the hand-driven pipeline and one process over the same micro-batches ran beside them
    assert math.isfinite(measured["hand_of_ideal"]) and measured["hand_of_ideal"] > 0
    assert math.isfinite(measured["micro_batch_ceiling"]) and measured["micro_batch_ceiling"] > 0
    assert "skipped" in skipped and "dualpipev" in skipped["skipped"]
    text = pipeline_efficiency.report(payload)
    assert "| 1f1b" in text and "n/a" in text and "by hand" in text


@pytest.fixture(scope="module")
def memory() -> dict[str, dict]:
    results = pipeline_memory.measure(("1f1b", "gpipe"), micro_batches=M, shape="tiny", timeout_s=280)
    return {r["schedule"]: r for r in results}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_every_micro_batch_saves_the_same_bytes_and_backward_frees_them(memory: dict[str, dict]) -> None:
    for schedule, result in memory.items():
        assert sorted(result["stages"]) == list(range(P)), schedule
        for stage, s in result["stages"].items():
            assert len(s["per_micro_batch"]) == M, (schedule, stage)
            assert len(set(s["per_micro_batch"])) == 1 and s["per_micro_batch"][0] > 0, (schedule, stage, s)
            assert s["left_after_step"] == 0, (schedule, stage, s)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_1f1b_holds_at_most_p_micro_batches_gpipe_holds_all(memory: dict[str, dict]) -> None:
    for stage in range(P):
        one_f1b = memory["1f1b"]["stages"][stage]
        gpipe = memory["gpipe"]["stages"][stage]
        one = one_f1b["per_micro_batch"][0]
        assert gpipe["per_micro_batch"][0] == one  # the schedule does not change a micro-batch's activations
        # Exact: parameters, the batch and torch's receive buffers are excluded from the count,
        # so nothing but the in-flight micro-batches' activations is left.
        assert one_f1b["peak"] == min(P - stage, M) * one <= P * one
        assert gpipe["peak"] == M * one


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_receive_buffers_are_those_in_flight(memory: dict[str, dict]) -> None:
    """One gradient at a time on the first stage; on the last, 1F1B's one micro-batch in flight, GPipe's M
    (torch's own stage held M on both: the negative control is tests/distributed/test_parity_memory_terms.py)."""
    shape = pipeline_efficiency.SHAPES["tiny"]
    hidden = 2 * shape["block_size"] * shape["n_embd"] * 4  # micro-batch of 2 sequences, fp32
    for schedule, result in memory.items():
        assert result["stages"][0]["receive_buffers"] == hidden, schedule
        assert result["stages"][1]["receive_buffers"] == (M if schedule == "gpipe" else 1) * hidden, schedule
    assert "peak / micro-batch" in pipeline_memory.report(list(memory.values()))
