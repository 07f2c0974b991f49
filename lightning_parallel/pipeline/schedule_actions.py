"""torch's own order of a multi-stage schedule's actions, per rank, without running it.

The planner needs two counts that only the schedule's order gives exactly: the receive buffers each stage
holds at once (``receive_buffers.py``) and the micro-batches each stage holds for backward at the rank's
peak (``planner/activations.py``). Both read the action lists torch builds for the layout, made here
with stand-in stages (no model, no process group), once per layout.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import NamedTuple

from torch import nn
from torch.distributed.pipelining.schedules import get_schedule_class

from lightning_parallel.pipeline.schedules import ScheduleSpec, stages_of_rank

__all__ = ["Action", "rank_actions"]


class Action(NamedTuple):
    kind: str
    """torch's computation type by name: FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, RECV_F, ..."""
    stage: int
    micro_batch: int


@functools.lru_cache(maxsize=256)
def rank_actions(
    spec: ScheduleSpec, pipeline_parallel: int, virtual_stages: int, micro_batches: int
) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions in torch's order (communication included where torch orders it; DualPipe-V's
    overlapped forward and backward as their two parts), for a multi-stage schedule."""
    p, n = pipeline_parallel, pipeline_parallel * virtual_stages
    stages = [
        SimpleNamespace(
            stage_index=s,
            num_stages=n,
            group_size=p,
            group_rank=0,
            is_first=s == 0,
            is_last=s == n - 1,
            submod=nn.Identity(),
            stage_index_to_group_rank={},
            has_backward=True,
            group=None,
        )
        for s in stages_of_rank(spec, 0, p, virtual_stages)
    ]
    schedule = get_schedule_class(spec.torch_name)(
        stages, n_microbatches=micro_batches, loss_fn=lambda a, b: a
    )
    order = getattr(schedule, "pipeline_order_with_comms", None) or schedule.pipeline_order
    return tuple(
        tuple(
            Action(action.computation_type.name, action.stage_index, action.microbatch_index)
            for outer in order[rank]
            if outer is not None
            for action in getattr(outer, "sub_actions", None) or [outer]
        )
        for rank in range(p)
    )
