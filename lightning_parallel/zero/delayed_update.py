"""ZeRO-Offload's delayed parameter update on FSDP2's host shards (``offload_update="delayed"``).

The exact host step (``zero/overlapped_step.py``) can only hide behind the backward it follows, and
not at all where clipping or a loss scale must see the whole backward first. ZeRO-Offload's answer
(Ren et al., 2021, "one-step delayed parameter update") trades exactness for the whole step: the
host computes step i's update while the device runs step i+1's forward and backward, which use the
parameters from before step i's update. Its authors turn it on after the first steps of training,
where the gradients change fastest; here it is off unless asked for, and on from the first step.

The rule, at each optimizer step i (``g_i`` the gradient of step i's backward, clipped and unscaled
as Lightning leaves it; the optimizer's hyper-parameters read at that moment):

1. the update launched at step i-1 is waited for and installed: the parameters become ``θ_i``;
2. ``θ_(i+1) = Adam(θ_i, g_i)`` is computed into a copy of the parameters (the offloaded ones by a
   worker thread, with torch's fused CPU Adam, which releases the GIL; those kept on the device at
   once), and installed at step i+1.

Whatever reads the model between two steps (a validation loop, a callback) sees the parameters in
use: one update behind. Saving a checkpoint, and the end of ``fit``, install the update in flight
first (:meth:`DelayedUpdate.settle`), so a checkpoint holds the latest parameters with their states;
the step after a save then starts with nothing in flight (a save moves the run, as it would on
resume). ``tests/zero/test_delayed_update.py`` trains against a one-process run of this rule.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.zero.deferred_update import DeferredUpdate
from lightning_parallel.zero.sharded_cpu_adam import (  # DeepSpeed's: imported with offload only
    _local,
    offloaded,
)

__all__ = ["DelayedUpdate"]

_Work = list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]  # (hyper-parameters, parameter, gradient)
_Updated = list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, its updated copy)


class DelayedUpdate(DeferredUpdate):
    """The delayed update of a :class:`~lightning_parallel.zero.sharded_cpu_adam.ShardedCPUAdam`'s parameters."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer, "lp-delayed-update")
        self._ready: _Updated = []
        self.installed = 0
        """Updates installed so far (one per optimizer step that had gradients; the engagement record reads it)."""
        self.launched = 0

    def launch(self) -> None:
        """Step i: install step i-1's update, then start step i's from the current gradients."""
        self.settle()
        host: _Work = []
        device: _Work = []
        for group in self.optimizer.param_groups:
            hyper = self.hyper(group)
            for param in group["params"]:
                if param.grad is not None:
                    (host if offloaded(param) else device).append((hyper, param, param.grad))
        if not host and not device:
            return
        self._ready = self._updated(device, fused=False)  # the device's own share: at once, in its stream
        self._in_flight = self._pool.submit(self._updated, host, fused=True)
        self.launched += 1

    @torch.no_grad()
    def _updated(self, work: _Work, *, fused: bool) -> _Updated:
        """Adam on a copy of each parameter (its states updated in place): the parameter itself is untouched."""
        out = []
        for hyper, param, grad in work:
            copy = _local(param).detach().clone()
            self.optimizer.torch_adam(hyper, [param], [grad], into=[copy], fused=fused)
            out.append((param, copy))
        return out

    @torch.no_grad()
    def settle(self) -> bool:
        """Wait for the update in flight and install it into the parameters; whether there was one."""
        if self._in_flight is None:
            return False
        updated = self._ready + self._in_flight.result()
        self._in_flight, self._ready = None, []
        for param, copy in updated:
            _local(param).copy_(copy)
        self.installed += 1
        return True
