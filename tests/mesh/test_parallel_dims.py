"""``ParallelDims``: degrees, ``data_parallel=-1`` inference, and errors that say what to change.

No process group: everything here is arithmetic done on construction, before any collective.
"""

from __future__ import annotations

import pytest

from lightning_parallel.mesh import AXIS_NAMES, ParallelDims


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(world_size=1), dict(pp=1, dp=1, tp=1)),
        (dict(world_size=8), dict(pp=1, dp=8, tp=1)),
        (dict(world_size=8, tensor_parallel=2), dict(pp=1, dp=4, tp=2)),
        (dict(world_size=8, tensor_parallel=8), dict(pp=1, dp=1, tp=8)),
        (dict(world_size=8, tensor_parallel=2, pipeline_parallel=2), dict(pp=2, dp=2, tp=2)),
        (dict(world_size=8, tensor_parallel=2, data_parallel=4), dict(pp=1, dp=4, tp=2)),
        (dict(world_size=16, tensor_parallel=2, expert_parallel=4), dict(pp=1, dp=8, tp=2)),
    ],
)
def test_degrees_and_inferred_data_parallel(kwargs: dict, expected: dict) -> None:
    dims = ParallelDims(**kwargs)
    assert dims.degrees == expected
    assert list(dims.degrees) == list(AXIS_NAMES) == ["pp", "dp", "tp"]  # outermost first
    product = expected["pp"] * expected["dp"] * expected["tp"]
    assert product == kwargs["world_size"]


def test_enabled_flags() -> None:
    dims = ParallelDims(world_size=16, tensor_parallel=2, pipeline_parallel=2, expert_parallel=2)
    assert (dims.tp_enabled, dims.pp_enabled, dims.dp_enabled, dims.ep_enabled) == (True, True, True, True)
    single = ParallelDims(world_size=1)
    assert (single.tp_enabled, single.pp_enabled, single.dp_enabled, single.ep_enabled) == (False,) * 4
    tp_only = ParallelDims(world_size=2, tensor_parallel=2)
    assert tp_only.tp_enabled and not tp_only.dp_enabled


def test_describe_names_every_axis() -> None:
    assert ParallelDims(world_size=8, tensor_parallel=2).describe() == "pp=1 x dp=4 x tp=2 (world 8)"
    # the setup log names the expert and context ranks inside dp (it left ep out)
    with_experts = ParallelDims(world_size=8, tensor_parallel=2, expert_parallel=2)
    assert with_experts.describe() == "pp=1 x dp=4 x tp=2 (ep=2 of dp) (world 8)"
    with_context = ParallelDims(world_size=8, context_parallel=2)
    assert with_context.describe() == "pp=1 x dp=8 x tp=1 (cp=2 of dp) (world 8)"


def test_mesh_before_build_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="setup_environment"):
        _ = ParallelDims(world_size=2).mesh


# Each bad layout: the argument, its value, and the fix must all be in the message.
BAD_LAYOUTS = [
    pytest.param(dict(world_size=0), ["`world_size=0`", "positive integer"], id="world_size=0"),
    pytest.param(
        dict(world_size=4, tensor_parallel=0), ["`tensor_parallel=0`", "positive integer"], id="tp=0"
    ),
    pytest.param(
        dict(world_size=4, tensor_parallel=-2), ["`tensor_parallel=-2`", "positive integer"], id="tp<0"
    ),
    pytest.param(
        dict(world_size=4, tensor_parallel=1.5), ["`tensor_parallel=1.5`", "positive integer"], id="tp=1.5"
    ),
    pytest.param(
        dict(world_size=4, tensor_parallel="2"), ["`tensor_parallel='2'`", "positive integer"], id="tp=str"
    ),
    pytest.param(
        dict(world_size=4, pipeline_parallel=0), ["`pipeline_parallel=0`", "positive integer"], id="pp=0"
    ),
    pytest.param(
        dict(world_size=4, expert_parallel=0), ["`expert_parallel=0`", "positive integer"], id="ep=0"
    ),
    pytest.param(
        dict(world_size=3, tensor_parallel=2),
        ["`tensor_parallel=2`", "world size 3", "Choose degrees whose product divides 3", "multiple of 2"],
        id="tp-does-not-divide-world",
    ),
    pytest.param(
        dict(world_size=8, tensor_parallel=2, pipeline_parallel=3),
        ["`tensor_parallel=2`", "`pipeline_parallel=3`", "= 6", "world size 8", "Choose degrees"],
        id="tp-x-pp-does-not-divide-world",
    ),
    pytest.param(
        dict(world_size=8, tensor_parallel=2, data_parallel=2),
        ["`data_parallel=2`", "= 4", "Leave `data_parallel` unset (-1)"],
        id="dp-mismatch",
    ),
    pytest.param(
        dict(world_size=8, tensor_parallel=2, data_parallel=0),
        ["`data_parallel=0`", "Leave `data_parallel` unset (-1)"],
        id="dp=0",
    ),
    pytest.param(
        dict(world_size=6, expert_parallel=4),
        ["`expert_parallel=4`", "data-parallel size 6", "Choose expert_parallel among [1, 2, 3, 6]"],
        id="ep-does-not-divide-dp",
    ),
]


@pytest.mark.parametrize(("kwargs", "fragments"), BAD_LAYOUTS)
def test_bad_layout_message_names_argument_value_and_fix(kwargs: dict, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ParallelDims(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


def test_axes_are_named_by_one_enum_and_the_mesh_keeps_plain_names() -> None:
    from lightning_parallel.mesh import AXIS_NAMES, Axis
    from lightning_parallel.mesh.parallel_dims import CONTEXT_AXIS_NAMES, EXPERT_AXIS_NAMES

    assert Axis.TP == "tp" and f"{Axis.DP_REPLICATE}" == "dp_replicate"  # a member is its name
    for names in (AXIS_NAMES, EXPERT_AXIS_NAMES, CONTEXT_AXIS_NAMES):
        assert all(type(name) is str for name in names)  # what checkpoints and logs see
        assert all(name in set(Axis) for name in names)
