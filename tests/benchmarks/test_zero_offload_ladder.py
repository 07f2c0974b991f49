"""The GPU check's ``largest`` phase: every size of the ladder is a model the recipe builds, and the sizes are tried
largest first among those whose host state could fit (2026-12-04b climbed from 2.7B and ran out of time)."""

from __future__ import annotations

from benchmarks.zero_offload import LADDER, fitting_first, parameters_of


def test_every_size_of_the_ladder_builds_and_is_about_its_name() -> None:
    for name in LADDER:  # the recipe refuses heads that do not divide the width (8.3B had 40 heads of 4096)
        assert abs(parameters_of(name) / 1e9 - float(name[:-1])) / float(name[:-1]) < 0.06, name


def test_sizes_are_tried_largest_first_among_those_the_host_can_hold() -> None:
    tried, skipped = fitting_first(["2.7B", "6.7B", "8.3B"], host=125 * 2**30)
    assert tried == ["6.7B", "2.7B"] and list(skipped) == ["8.3B"]
    assert "155 GiB" in skipped["8.3B"]
    assert fitting_first(["2.7B", "8.3B"], host=None) == (
        ["8.3B", "2.7B"],
        {},
    )  # unknown host: all, largest first
