"""FSDP2's units under pipeline schedules: when they reduce-scatter and reshard across a step's micro-batches.

``zero/fsdp.py`` shards the model into units; a pipeline schedule then runs each stage's forward and
backward once per micro-batch outside any wrapper FSDP2 could see, so the runner
(``pipeline/runner.py``, ``pipeline/last_backward.py``) sets the units before the schedule (accumulate whole,
or reduce every micro-batch: ``zero_reshard``), opens them to reduce during each stage's last backward,
reduces what their hooks left, and closes forwards a stage's early exit interrupted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule

from lightning_parallel.compat import (
    fsdp_close_forward,
    fsdp_in_forward,
    fsdp_post_backward,
    fsdp_root_callback,
)

__all__ = [
    "accumulate_without_reducing",
    "before_schedule",
    "finish_interrupted_forwards",
    "reduce_accumulated",
    "reduce_every_micro_batch",
    "reduce_in_backward",
]


def accumulate_without_reducing(units: list[FSDPModule]) -> None:
    """Before a pipeline schedule's micro-batches: keep unsharded gradients and parameters until the last.

    The schedule runs backward once per micro-batch outside any ``no_sync`` a wrapper could see; without
    this every micro-batch would reduce-scatter (and re-gather) on its own.
    """
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)
        unit.set_is_last_backward(False)


def finish_interrupted_forwards(units: list[FSDPModule], output: torch.Tensor) -> None:
    """A pipeline stage's forward left the user's model by an exception (``pipeline/stages.py: StageExit``)
    from its last block: FSDP2's post-forward of that block and of the units around it never ran. Run it
    now, innermost first, on the stage's output: the units reshard after forward if they are to, and their
    pre-backward hooks (which gather the parameters again for backward) sit on the tensor the stage's
    backward starts from. Without it a unit resharded by an earlier micro-batch's backward entered the
    next backward with freed parameters (measured: ZeRO-3 with ``zero_reshard="micro_batch"``)."""
    open_units = [u for u in units if fsdp_in_forward(u)]
    inside = {id(u): sum(u in other.modules() for other in open_units if other is not u) for u in open_units}
    for unit in sorted(open_units, key=lambda u: -inside[id(u)]):
        fsdp_close_forward(unit, output)


def before_schedule(reshard: str, stage: int) -> Callable[[list[FSDPModule]], None]:
    """What a pipeline schedule's FSDP2 units are set to before its micro-batches, for ``zero_reshard``:
    accumulate whole (``"step"``), or reduce-scatter every micro-batch and, at stage 3, reshard too."""
    if reshard == "micro_batch":
        return lambda units: reduce_every_micro_batch(units, reshard_parameters=stage == 3)
    return accumulate_without_reducing


def reduce_every_micro_batch(units: list[FSDPModule], *, reshard_parameters: bool) -> None:
    """Before a pipeline schedule's micro-batches, ``zero_reshard="micro_batch"``: every micro-batch's backward
    reduce-scatters into the sharded gradients; ``reshard_parameters`` (ZeRO-3) also frees the gathered
    parameters after it (the forward already does, ``reshard_after_forward``). ZeRO-2 keeps them whole through
    the micro-batches; its stage's last backward reshards them (:func:`reduce_in_backward`) for the step."""
    for unit in units:
        unit.set_requires_gradient_sync(True, recurse=False)
        unit.set_reshard_after_backward(reshard_parameters, recurse=False)
        unit.set_is_last_backward(True)


def reduce_in_backward(units: list[FSDPModule]) -> None:
    """Before a pipeline stage's last backward of the batch: ``units`` (whose parameters no later backward of
    the batch touches) reduce-scatter from their own post-backward hooks, as the backward leaves each one."""
    for unit in units:
        unit.set_requires_gradient_sync(True, recurse=False)
        unit.set_reshard_after_backward(True, recurse=False)
        unit.set_is_last_backward(True)


def reduce_accumulated(units: list[FSDPModule]) -> None:
    """After a stage's last backward: one reduce-scatter per unit for what its hooks did not reduce, then reshard.

    What torch's own ``PipelineStage`` does for an FSDP2 stage module (``_PipelineStageBase.
    _post_backward``, torch 2.13): the post-backward of every parameter group, then the root's final
    callback that waits for the reductions; our stages are not FSDP modules themselves (each runs
    the user's whole step), so the runner calls it. A group its hooks already reduced holds no
    gradient and issues nothing; the zero-bubble schedules' weight pass (outside autograd's hooks)
    is reduced here.
    """
    roots = []
    for unit in units:
        unit.set_requires_gradient_sync(True, recurse=False)
        unit.set_reshard_after_backward(True, recurse=False)
        unit.set_is_last_backward(True)
        if fsdp_post_backward(unit):
            roots.append(unit)
    for unit in roots:
        fsdp_root_callback(unit)
