"""The constructor hands its arguments to the configuration as one typed record, with the same defaults."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_parallel import HybridParallelStrategy
from lightning_parallel.config.strategy_arguments import StrategyArguments
from lightning_parallel.planner.layout import Layout, strategy_refusals

LIGHTNING_ONLY = {"self", "process_group_backend", "timeout"}  # Lightning's strategy takes these


def test_the_record_has_every_constructor_argument_with_its_default() -> None:
    signature = inspect.signature(HybridParallelStrategy.__init__).parameters
    constructor = {name: p.default for name, p in signature.items() if name not in LIGHTNING_ONLY}
    record = {f.name: f.default for f in dataclasses.fields(StrategyArguments)}
    assert record == constructor


def test_a_misspelt_argument_fails_where_it_is_written() -> None:
    with pytest.raises(TypeError, match="tensor_paralel"):
        StrategyArguments(tensor_paralel=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("layout", "refused"),
    [
        (Layout(pipeline_parallel=2, micro_batches=2, loss_parallel=True), "`loss_parallel=True` with"),
        (Layout(pipeline_parallel=2, micro_batches=1, pipeline_schedule="1f1b"), "micro_batches"),
        (Layout(pipeline_parallel=2, micro_batches=2), None),  # the negative control: accepted
        (Layout(tensor_parallel=2, data_parallel=2, zero_stage=3, offload="nvme"), None),
    ],
)
def test_the_planner_asks_the_strategy_s_own_rules(layout: Layout, refused: str | None) -> None:
    """One rulebook: the planner runs the strategy's configuration and launch checks on the arguments a layout
    becomes, so it proposes nothing the strategy refuses at setup."""
    problems = strategy_refusals(layout)
    if refused is None:
        assert problems == []
    else:
        assert len(problems) == 1 and refused in problems[0] and "HybridParallelStrategy" in problems[0]
