"""Which gradient reductions each layout runs, decided from the configuration alone (no processes).

``decide_gradient_reductions`` is the one place that decides them (``parallelize/gradients.py``);
the distributed parity tests check that what it installs reproduces the one-process gradients.
Here: the decision itself, for the layouts whose reductions differ, so that a change to one
layout's reductions shows up as a changed line, not as a parity failure somewhere else.
"""

from __future__ import annotations

import pytest

from lightning_parallel import HybridParallelStrategy, PowerSGD
from lightning_parallel.config.validation import resolve_dims
from lightning_parallel.parallelize import decide_gradient_reductions


def _decided(devices: int, **arguments: object) -> list[str]:
    config = HybridParallelStrategy(**arguments).config
    return [str(r) for r in decide_gradient_reductions(config, resolve_dims(config, "test", devices, 1))]


@pytest.mark.parametrize(
    ("devices", "arguments", "expected"),
    [
        (1, {}, []),
        (2, {}, ["inside backward: all gradients, mean over dp"]),
        (4, {"tensor_parallel": 2}, ["inside backward: all gradients, mean over dp"]),
        (2, {"gradient_compression": "bf16"}, ["inside backward: all gradients, mean over dp, compressed ('bf16')"]),
        (2, {"tensor_parallel": 2}, []),  # one data-parallel replica
        (4, {"pipeline_parallel": 2},
         ["during the last backward: dense gradients, mean over dp", "after backward: tied gradients, sum over pp"]),
        (4, {"pipeline_parallel": 2, "gradient_compression": "powersgd"},
         ["during the last backward: tied gradients, mean over dp", "after backward: tied gradients, sum over pp",
          f"after backward: dense but tied gradients, mean over dp, compressed ({PowerSGD()!r})"]),
        (4, {"expert_parallel": 2},
         ["during the last backward: dense gradients, mean over dp",
          "during the last backward: experts gradients, sum / dp size over dp_replicate"]),
        (2, {"zero_stage": 3}, ["in the optimizer step: all gradients, mean (ZeRO's) over dp"]),
        (4, {"zero_stage": 1, "tensor_parallel": 2}, ["in the optimizer step: all gradients, mean (ZeRO's) over dp"]),
        (4, {"zero_stage": 3, "tensor_parallel": 2},  # FSDP2: reduce-scatter in backward (zero/fsdp.py)
         ["inside backward: all gradients, mean (reduce-scatter of ZeRO-3's shards) over dp",
          "during the last backward: strided vector gradients, mean over dp"]),
        (4, {"zero_stage": 3, "expert_parallel": 2},  # FSDP2: experts their own units over their replicas
         ["inside backward: dense gradients, mean (reduce-scatter of ZeRO-3's shards) over dp",
          "inside backward: experts gradients, sum / dp size (reduce-scatter of ZeRO-3's shards) over dp_replicate",
          "during the last backward: strided vector gradients, mean over dp"]),
        (4, {"zero_stage": 2, "expert_parallel": 2},  # ZeRO-2: whole parameters between steps
         ["inside backward: dense gradients, mean (reduce-scatter of ZeRO-2's shards) over dp",
          "inside backward: experts gradients, sum / dp size (reduce-scatter of ZeRO-2's shards) over dp_replicate",
          "during the last backward: strided vector gradients, mean over dp",
          "after the optimizer step: all parameters' gradients, all-gather over dp"]),
        (4, {"zero_stage": 3, "pipeline_parallel": 2, "expert_parallel": 2},
         ["during the last backward: dense gradients, mean (reduce-scatter of ZeRO-3's shards), once per batch over dp",
          "during the last backward: experts gradients, sum / dp size (reduce-scatter of ZeRO-3's shards), once per"
          " batch over dp_replicate",
          "during the last backward: strided vector gradients, mean over dp", "after backward: tied gradients, sum over pp"]),
        (4, {"zero_stage": 1, "pipeline_parallel": 2, "expert_parallel": 2},
         ["during the last backward: dense gradients, mean over ep", "after backward: tied gradients, sum over pp",
          "after backward: experts gradients, divided by ep", "in the optimizer step: all gradients, mean (ZeRO's) over dp_replicate"]),
    ],
)  # fmt: skip
def test_each_layout_reduces_its_gradients_as_decided(
    devices: int, arguments: dict, expected: list[str]
) -> None:
    assert _decided(devices, **arguments) == expected


def test_zero_moves_the_data_parallel_mean_into_its_step() -> None:
    """The same layout with and without ZeRO: only the data-parallel mean moves (negative control of the above)."""
    without = _decided(4, expert_parallel=2, pipeline_parallel=2)
    with_zero = _decided(4, expert_parallel=2, pipeline_parallel=2, zero_stage=1)
    assert without != with_zero
    assert "after backward: tied gradients, sum over pp" in without
    assert "after backward: tied gradients, sum over pp" in with_zero
    assert not any("ZeRO" in line for line in without)
