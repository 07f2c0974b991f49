"""A parallelized module is reused by a later Trainer entry point only under the very same layout.

``ParallelDims.degrees`` (the mesh axes pp, dp, tp) cannot tell expert parallelism apart: ep=2 and
ep=1 on two ranks both have dp=2. ``ParallelDims.layout`` adds ep; it is what a reused module
(``parallelize.recall``) and a checkpoint's metadata are compared by.
"""

from __future__ import annotations

import pytest
from torch import nn

from lightning_parallel.mesh import ParallelDims
from lightning_parallel.parallelize import Parallelized, recall


def test_expert_parallel_changes_the_layout_though_not_the_degrees() -> None:
    dense, experts = ParallelDims(world_size=2), ParallelDims(world_size=2, expert_parallel=2)
    assert dense.degrees == experts.degrees == {"pp": 1, "dp": 2, "tp": 1}  # the two are mistaken by degrees
    assert dense.layout != experts.layout
    assert experts.layout == {"pp": 1, "dp": 2, "ep": 2, "cp": 1, "tp": 1}


def test_a_module_parallelized_with_ep2_is_refused_under_ep1() -> None:
    dense, experts = ParallelDims(world_size=2), ParallelDims(world_size=2, expert_parallel=2)
    module = nn.Linear(2, 2)
    assert recall(module, dense.layout) is None  # never parallelized
    earlier = Parallelized(experts.layout, blocks=[])
    earlier.remember(module)
    assert recall(module, experts.layout) is earlier  # the same layout: reused as it is
    with pytest.raises(ValueError, match=r"already parallelized with the layout \{'pp': 1, 'dp': 2, 'ep': 2"):
        recall(module, dense.layout)
