"""The importance split of FSDP2's offloaded host step (``offload_update=ImportanceSplit(...)``).

With the exact host step the device waits for the whole CPU Adam wherever backward cannot hide it
(``zero/overlapped_step.py``); with the delayed update every parameter is one update behind
(``zero/delayed_update.py``). DeepSpeed's ZenFlow (Lan et al., 2025) observed that a few rows of each
matrix carry most of the gradient's norm, and keeps those current while the rest wait: that idea, as
a rule of our own, on the host shards FSDP2 offloads. Only the chosen rows' Adam is on the step's
path; the others' sums and their update run on a worker during the next step's forward and backward
(it holds this step's gradients: one more gradient's worth of host memory, and an fp32 sum of the other
rows).

The rule, per matrix ``W`` (two or more dimensions; rows are ``W[i]``, chosen over the whole parameter,
not a rank's shard) at optimizer step ``s`` of the cycle (``s = 1, 2, ...``; ``t`` the parameter's Adam
step count, counted up by one at every optimizer step; ``g`` the gradient as Lightning leaves it,
clipped and unscaled; ``k = ceil(top_rows x rows)``):

1. the other rows' update launched at the previous flush, if any, is installed;
2. at ``s = 1`` the ``k`` rows of largest ``|g[i]|`` are chosen;
3. the chosen rows take an Adam step with ``g`` at ``t``: parameters and states of those rows only;
4. the other rows' gradients are added to a host sum (by the worker);
5. when ``s`` is a multiple of ``update_interval``, the other rows take one Adam step at ``t`` with the
   mean of the sum, computed by a worker into copies (their states in place) and installed at
   step 1 of the next optimizer step; the sum restarts;
6. when ``s`` is a multiple of ``select_interval`` (a multiple of ``update_interval``: nothing is pending
   then), the rows are chosen again from ``g``.

Vectors (norm gains, biases) and parameters on the device take torch's Adam whole, at once. Between two
steps (a validation loop, a callback) the model shows the other rows as of their last installed
update. Saving a checkpoint, and the end of ``fit``, install the update in flight and apply whatever
sum is pending at once (step 5 early), and the cycle starts again at ``s = 1``: a checkpoint holds every
gradient seen, and a run resumed from it continues as the run that saved it
(``tests/zero/test_importance_split.py`` trains against a one-process implementation of this rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from lightning_parallel.zero.arguments import ImportanceSplit
from lightning_parallel.zero.deferred_update import DeferredUpdate
from lightning_parallel.zero.sharded_cpu_adam import (  # DeepSpeed's: imported with offload only
    _local,
    adam_on,
    offloaded,
)

__all__ = ["ImportanceSplitUpdate"]


@dataclass
class _Rows:
    """One matrix's split on this rank: local row indices of each side and the others' pending gradient sum (their
    rows only, in the order of ``others``)."""

    chosen: torch.Tensor
    others: torch.Tensor
    pending: torch.Tensor | None = None
    summed: int = 0
    hyper: dict[str, Any] | None = None
    """The hyper-parameters of the last step summed into ``pending``: a settle applies it as that step's flush would."""


@dataclass
class _Deferred:
    """The other rows' update of one matrix, computed by the worker: installed at the next step."""

    param: torch.Tensor
    rows: torch.Tensor
    values: torch.Tensor = field(default_factory=lambda: torch.empty(0))


class _Work(NamedTuple):
    """One matrix's part of the worker's task at one step: add its gradient to the others' sum and, at a flush, compute
    their update."""

    hyper: dict[str, Any]
    param: torch.Tensor
    rows: _Rows
    grad: torch.Tensor
    flush: bool
    step: float


def _row_placements(param: DTensor, *, partial_elsewhere: bool) -> list[Placement]:
    """How a vector over ``param``'s rows (dim 0) lies on its mesh: sharded where dim 0 is; where another dim is
    sharded, a partial sum (``partial_elsewhere``: row norms) or replicated (row indices)."""
    return [
        p
        if isinstance(p, Shard) and p.dim == 0
        else Partial()
        if isinstance(p, Shard) and partial_elsewhere
        else Replicate()
        for p in param.placements
    ]


def global_row_indices(param: torch.Tensor) -> torch.Tensor:
    """The indices, in the whole parameter, of this rank's rows of ``param`` (dim 0): a replicated ``arange`` laid
    out as ``param`` lays out dim 0 (no communication), on the mesh's device."""
    if not isinstance(param, DTensor):
        return torch.arange(param.shape[0])
    mesh = param.device_mesh
    rows = torch.arange(param.shape[0], device=mesh.device_type)
    whole = DTensor.from_local(rows, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, _row_placements(param, partial_elsewhere=False)).to_local().cpu()


def chosen_rows(param: torch.Tensor, grad: torch.Tensor, top_rows: float) -> _Rows:
    """The split of ``param``'s local rows: the ``ceil(top_rows x rows)`` rows of the whole parameter whose gradient
    has the largest norm (every rank computes the same choice from the gathered row norms). The norms travel on
    the mesh's device: the host shards of an offloaded parameter cannot cross NCCL themselves."""
    local = _local(grad)
    squares = local.float().square().sum(dim=tuple(range(1, local.ndim)))
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        squares = DTensor.from_local(
            squares.to(mesh.device_type),
            mesh,
            _row_placements(param, partial_elsewhere=True),
            run_check=False,
            shape=torch.Size([param.shape[0]]),
            stride=(1,),
        ).full_tensor()
    top = torch.zeros(param.shape[0], dtype=torch.bool)
    chosen = max(1, math.ceil(round(top_rows * param.shape[0], 9)))  # 0.07 x 100 is 7.000000000000001
    top[squares.cpu().topk(chosen).indices] = True
    mine = top[global_row_indices(param)]
    return _Rows(chosen=mine.nonzero().flatten(), others=(~mine).nonzero().flatten())


class ImportanceSplitUpdate(DeferredUpdate):
    """The importance split of a :class:`~lightning_parallel.zero.sharded_cpu_adam.ShardedCPUAdam`'s offloaded
    matrices (the rule: this module's docstring)."""

    def __init__(self, optimizer: Any, rule: ImportanceSplit) -> None:
        super().__init__(optimizer, "lp-importance-split")
        self.rule = rule
        self._rows: dict[int, _Rows] = {}
        self._step = 0
        self.rows_at_once = 0
        """Rows updated at once, summed over steps and matrices (this rank; the engagement record reads it)."""
        self.rows_deferred = 0
        """Rows whose later update was installed (by the next step or a settle), summed likewise."""
        self.launched = 0
        self.installed = 0

    def launch(self) -> None:
        """One optimizer step of the rule (steps 1-6): the chosen rows here, the sums and the flush on the worker."""
        self._install_in_flight()
        self._step += 1
        flush = self._step % self.rule.update_interval == 0
        choose_again = self._step % self.rule.interval_of_selection == 0
        work: list[_Work] = []
        for group in self.optimizer.param_groups:
            hyper = self.hyper(group)
            whole = [p for p in group["params"] if p.grad is not None and not self._splits(p)]
            if whole:
                self.optimizer.torch_adam(
                    hyper, whole, [p.grad for p in whole], fused=all(map(offloaded, whole))
                )
            for param in (p for p in group["params"] if p.grad is not None and self._splits(p)):
                rows = self._rows.get(id(param)) or chosen_rows(param, param.grad, self.rule.top_rows)
                state = self.optimizer._state_of(param)
                state["step"] += 1
                grad = _local(param.grad)
                self._adam_rows(
                    hyper, param, grad.index_select(0, rows.chosen), rows.chosen, float(state["step"])
                )
                self.rows_at_once += rows.chosen.numel()
                work.append(_Work(hyper, param, rows, grad, flush, float(state["step"])))
                # from this step's gradients; the sum of the rows chosen until now is flushed
                if choose_again:
                    self._rows[id(param)] = chosen_rows(param, param.grad, self.rule.top_rows)
                else:
                    self._rows[id(param)] = rows
        if work:
            self._in_flight = self._pool.submit(self._worker_step, work)
            self.launched += flush

    @staticmethod
    def _splits(param: torch.Tensor) -> bool:
        return param.ndim >= 2 and offloaded(param)

    def _worker_step(self, work: list[_Work]) -> list[_Deferred]:
        """On the worker, during the next forward and backward: the others' sums (4) and, at a flush, their update
        into copies (5); nothing else touches those rows or their sums until the next step waits for this."""
        updates = []
        for item in work:
            rows = item.rows
            others = item.grad.index_select(
                0, rows.others
            ).float()  # a new tensor: the first step's sum as it is
            rows.pending = others if rows.pending is None else rows.pending.add_(others)
            rows.summed, rows.hyper = rows.summed + 1, item.hyper
            if item.flush:
                update = _Deferred(item.param, rows.others)
                mean = rows.pending / rows.summed
                self._adam_rows(item.hyper, item.param, mean, rows.others, item.step, into=update)
                rows.pending, rows.summed = None, 0
                updates.append(update)
        return updates

    @torch.no_grad()
    def _adam_rows(
        self,
        hyper: dict[str, Any],
        param: torch.Tensor,
        grad_rows: torch.Tensor,
        rows: torch.Tensor,
        step: float,
        into: _Deferred | None = None,
    ) -> None:
        """Adam at step count ``step`` on ``rows`` of ``param`` (local indices): their states in place, their values
        in place or, with ``into``, into ``into.values`` (installed later)."""
        state = self.optimizer.state[param]
        local = _local(param)
        values = local.index_select(0, rows)
        exp_avg, exp_avg_sq = (_local(state[k]) for k in ("exp_avg", "exp_avg_sq"))
        moments = [exp_avg.index_select(0, rows), exp_avg_sq.index_select(0, rows)]
        adam_on(
            [values],
            [grad_rows.to(values.dtype)],
            [moments[0]],
            [moments[1]],
            [torch.tensor(step - 1.0)],
            hyper,
            decoupled=self.optimizer.adam_w_mode,
            fused=True,
        )
        exp_avg.index_copy_(0, rows, moments[0])
        exp_avg_sq.index_copy_(0, rows, moments[1])
        if into is None:
            local.index_copy_(0, rows, values)
        else:
            into.values = values

    @torch.no_grad()
    def _install_in_flight(self) -> bool:
        """Wait for the worker's last task and install the update it computed, if any; whether there was one."""
        if self._in_flight is None:
            return False
        updates = self._in_flight.result()
        self._in_flight = None
        for update in updates:
            _local(update.param).index_copy_(0, update.rows, update.values)
            self.rows_deferred += update.rows.numel()
        self.installed += bool(updates)
        return bool(updates)

    @torch.no_grad()
    def settle(self) -> bool:
        """Install the update in flight, apply every pending sum at once, and start the cycle again (a checkpoint,
        the end of ``fit``); whether any parameter changed."""
        changed = self._install_in_flight()
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                rows = self._rows.get(id(param))
                if rows is None or rows.pending is None:
                    continue
                mean = rows.pending / rows.summed
                # the last summed step's learning rate, not the scheduler's next one
                hyper = rows.hyper if rows.hyper is not None else self.hyper(group)
                self._adam_rows(hyper, param, mean, rows.others, float(self.optimizer.state[param]["step"]))
                self.rows_deferred += rows.others.numel()
                changed = True
        self._rows.clear()
        self._step = 0
        return changed
