"""How far a compressed-gradient run may drift from the uncompressed one: a bound from what the compressor left out.

Both runs start from the same weights and see the same batches under SGD with momentum ``mu``
and learning rate ``lr`` (the families' optimizer). Write ``x_t`` and ``u_t`` for the compressed
and uncompressed parameters before step ``t``, ``g(.)`` for the exact mean gradient of step
``t``'s batch, ``g~_t`` for what the all-reduce returned, and ``delta_t = g~_t - g(x_t)`` for the
compression error, which the hook records give exactly (:func:`step_errors`: each call's result
against the mean of the ranks' inputs). The difference ``D_t = x_t - u_t`` is driven by two things:

- the compression error, propagated linearly by the optimizer. With error feedback (PowerSGD)
  each rank keeps what its approximation left out, so the errors telescope:
  ``delta_t = e_{t-1} - e_t`` with ``e_t`` the ranks' mean error memory, and the momentum
  sum ``sum_t c_{T,t} delta_t`` equals ``-sum_t mu^(T-1-t) e_t``: the drift is bounded by the
  memory, not by the sum of the errors. Without feedback (bf16) the errors add up;
- the gradient's own change between the two trajectories, ``|g(x_t) - g(u_t)| <= L |D_t|``,
  with ``L`` the loss's curvature along the departure: ``|H(u_t) D_t| / |D_t|``, a
  Hessian-vector product at the uncompressed parameters (taken in the run), its largest value
  over the steps times :data:`SMOOTHNESS_SAFETY` for the segment between ``u_t`` and ``x_t``.
  (The largest Hessian eigenvalue, about 20 here, would bound every direction; at lr 0.1 it
  makes the recursion grow fivefold per step and the bound say nothing.)

:func:`deviation_bounds` runs the resulting recursion on norms; the loss then moves by at most
``|grad| d + L d^2 / 2``. The compression errors come from the hook records, the gradients from
the uncompressed run; the compressed run's parameters enter only through the direction of the
curvature, never as a distance, so an error the compressor did not make (a gradient changed
after the reduction) breaks the bound: the negative control.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SMOOTHNESS_SAFETY", "deviation_bounds", "loss_bounds", "step_errors"]

# The curvature is measured at u_t only; the segment to x_t is short (|D| << |u|) but unmeasured:
# twice the largest value seen over the steps.
SMOOTHNESS_SAFETY = 2.0


def _steps(calls: list[dict[str, Any]]) -> list[list[int]]:
    """Indices of one rank's calls, step by step: a step ends when every unit has had its last bucket."""
    units = {c["unit"] for c in calls}
    steps, current, finished = [], [], set()
    for i, call in enumerate(calls):
        current.append(i)
        if call["last"]:
            finished.add(call["unit"])
        if finished == units:
            steps.append(current)
            current, finished = [], set()
    if current:
        raise ValueError(f"the last {len(current)} hook call(s) belong to no complete step")
    return steps


def step_errors(ranks: list[list[dict[str, Any]]], feedback: bool) -> list[float]:
    """Per step: the norm of the ranks' mean error memory (``feedback``) or of the step's error.

    From the recorded hook calls (tests/memory/powersgd_oracle.py, ``HookRecorder``): the error of
    a call is its result minus the mean of the ranks' inputs; the memory of a bucket is minus the
    sum of its errors so far (what the approximations left out and the ranks still hold). A bucket
    whose layout changed carries no memory over (DDP rebuilds its buckets after the first step,
    when PowerSGD is still exact).
    """
    memory: dict[tuple[int, int], tuple[list, torch.Tensor]] = {}
    out = []
    for indices in _steps(ranks[0]):
        squared = 0.0
        for i in indices:
            calls = [rank[i] for rank in ranks]
            exact = sum(c["before"] for c in calls) / len(calls)
            error = (calls[0]["after"] - exact).double()
            if not feedback:
                squared += float(error.pow(2).sum())
                continue
            key, layout = (calls[0]["unit"], calls[0]["index"]), (calls[0]["shapes"], calls[0]["offsets"])
            previous = memory.get(key)
            held = previous[1] if previous is not None and previous[0] == layout else torch.zeros_like(error)
            memory[key] = (layout, held - error)
        if feedback:
            squared = sum(float(m.pow(2).sum()) for _, m in memory.values())
        out.append(squared**0.5)
    return out


def deviation_bounds(
    errors: list[float], smoothness: float, lr: float, momentum: float, feedback: bool
) -> list[float]:
    """Bounds on ``|x_t - u_t|`` for ``t = 0 .. len(errors)`` (see the module docstring).

    ``errors``: :func:`step_errors` of the same ``feedback``. ``smoothness``: ``L``.
    """
    bounds = [0.0]
    linear_velocity = linear = memory = 0.0  # the compression error's part
    drift_velocity = drift = 0.0  # the part from the gradient's change between trajectories
    for t, error in enumerate(errors):
        drift_velocity = momentum * drift_velocity + smoothness * bounds[t]
        drift += lr * drift_velocity
        if feedback:  # |sum_s c_{t+1,s} delta_s| <= sum_s mu^(t-s) |e_s|
            memory = momentum * memory + error
            linear = lr * memory
        else:
            linear_velocity = momentum * linear_velocity + error
            linear += lr * linear_velocity
        bounds.append(linear + drift)
    return bounds


def loss_bounds(bounds: list[float], gradient_norms: list[float], smoothness: float) -> list[float]:
    """``|loss(x_t) - loss(u_t)| <= |g(u_t)| d_t + L d_t^2 / 2`` for each step ``t`` with a gradient."""
    return [g * d + smoothness * d * d / 2 for g, d in zip(gradient_norms, bounds, strict=False)]
