"""Schedule names, stage placement, micro-batch rules and the stage split: pure functions, no processes."""

from __future__ import annotations

import pytest

from lightning_parallel.config.arguments import check_micro_batches, resolve_schedule, virtual_stages_for
from lightning_parallel.pipeline.schedules import (
    SCHEDULES,
    available_schedules,
    ideal_efficiency,
    stage_owner,
    stages_of_rank,
)
from lightning_parallel.pipeline.split import balanced_boundaries, check_user_boundaries, stage_ranges


def test_every_schedule_of_this_torch_is_offered() -> None:
    assert available_schedules() == list(SCHEDULES)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("1F1B", "1f1b"), ("GPipe", "gpipe"), ("zero_bubble", "interleaved_zero_bubble"), ("ZB-V", "zbv"),
     ("DualPipe-V", "dualpipev"), (None, "1f1b")],
)  # fmt: skip
def test_names_are_case_and_dash_insensitive(name: str | None, expected: str) -> None:
    assert resolve_schedule(name).name == expected


def test_unknown_schedule_is_refused_with_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"`pipeline_schedule='2f2b'` is not a known schedule\. Choose one of 'gpipe'"
    ):
        resolve_schedule("2f2b")


def test_virtual_stages() -> None:
    assert virtual_stages_for(resolve_schedule("1f1b"), None) == 1
    assert virtual_stages_for(resolve_schedule("interleaved_1f1b"), None) == 2
    assert virtual_stages_for(resolve_schedule("interleaved_1f1b"), 3) == 3
    assert virtual_stages_for(resolve_schedule("zbv"), None) == 2
    with pytest.raises(ValueError, match="holds one stage per rank"):
        virtual_stages_for(resolve_schedule("1f1b"), 2)
    with pytest.raises(ValueError, match="exactly 2 stages on each rank"):
        virtual_stages_for(resolve_schedule("dualpipev"), 3)
    with pytest.raises(ValueError, match="at least 2 stages per rank"):
        virtual_stages_for(resolve_schedule("looped_bfs"), 1)


def test_stage_placement_loop_and_v() -> None:
    loop, v = resolve_schedule("interleaved_1f1b"), resolve_schedule("zbv")
    assert [stage_owner(loop, s, 2) for s in range(4)] == [0, 1, 0, 1]
    assert [stage_owner(v, s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert stages_of_rank(v, 0, 2, 2) == [0, 3]
    assert stages_of_rank(loop, 1, 4, 2) == [1, 5]


@pytest.mark.parametrize(
    ("name", "micro_batches", "fragment"),
    [("interleaved_1f1b", 3, "multiple of `pipeline_parallel=2`"), ("zbv", 1, "at least `pipeline_parallel=2`"),
     ("dualpipev", 3, "at least 2 x `pipeline_parallel` = 4"), ("1f1b", 0, "must be a positive integer"),
     ("1f1b", 1, "needs at least `pipeline_parallel=2` micro-batches")],
)  # fmt: skip
def test_micro_batch_counts_a_schedule_cannot_run_are_refused(
    name: str, micro_batches: int, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("`", "`")):
        check_micro_batches(resolve_schedule(name), micro_batches, 2)


def test_ideal_efficiency() -> None:
    assert ideal_efficiency(resolve_schedule("1f1b"), 8, 2, 1) == pytest.approx(8 / 9)
    assert ideal_efficiency(resolve_schedule("interleaved_1f1b"), 8, 2, 2) == pytest.approx(8 / 8.5)
    assert ideal_efficiency(resolve_schedule("zbv"), 8, 2, 2) == 1.0


def test_balanced_boundaries_minimise_the_largest_stage() -> None:
    assert balanced_boundaries([1] * 8, 4) == [0, 2, 4, 6]
    assert balanced_boundaries([1] * 5, 2) == [0, 2]  # the remainder goes to the later stage
    assert balanced_boundaries([5, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert stage_ranges([0, 2], 5) == [range(0, 2), range(2, 5)]


def test_more_stages_than_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"4 stages .* only 2 blocks"):
        balanced_boundaries([1, 1], 4)


@pytest.mark.parametrize("starts", [[0], [3, 2], [4], [1, 2]])
def test_bad_user_boundaries_are_refused(starts: list[int]) -> None:
    with pytest.raises(ValueError, match="pipeline_boundaries"):
        check_user_boundaries(starts, 4, 2)


def test_user_boundaries() -> None:
    assert check_user_boundaries([1], 4, 2) == [0, 1]
