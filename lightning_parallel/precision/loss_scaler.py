"""Dynamic loss scaling whose step-or-skip decision is the same on every rank.

With fp16, ``torch.amp.GradScaler`` skips the optimizer step when a gradient overflowed
and backs the scale off. Under model parallelism each rank sees only its own shards: if
the overflow sits in a shard that rank 1 holds, rank 1 would skip while rank 0 steps, and
the model drifts apart for good (replicated norms differ, shards no longer match).
:class:`DistributedGradScaler` all-reduces the found-inf flags (MAX) over the world group
right after unscaling, before anything reads them, so ``step`` and ``update`` decide alike
everywhere and the scales stay identical.

Unscaling works on local tensors. torch 2.13 can unscale DTensor gradients (it has a rule
for ``_amp_foreach_non_finite_check_and_unscale_``), but that rule reduces the flag only
over the mesh of the *first* gradient of each dtype batch: never across pipeline stages,
not at all when that gradient is replicated, and with one hidden collective per batch.
Here: no hidden collectives, exactly one all-reduce per optimizer and step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from typing_extensions import override

__all__ = ["DistributedGradScaler"]


class DistributedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` that agrees across ranks on whether gradients overflowed.

    Args:
        device: device type of the gradients and the scale (``"cuda"`` or ``"cpu"``).
        group: the ranks that must agree; ``None`` is the world group (every rank of a
            model-parallel job must step or skip together).
        **kwargs: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
            ``enabled``, as for ``torch.amp.GradScaler``.
    """

    def __init__(self, device: str = "cuda", *, group: ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.group = group

    @classmethod
    def from_scaler(
        cls, scaler: torch.amp.GradScaler, *, group: ProcessGroup | None = None
    ) -> DistributedGradScaler:
        """Build one with the configuration and state of ``scaler`` (e.g. the one Lightning created)."""
        if isinstance(scaler, DistributedGradScaler):
            scaler.group = group
            return scaler
        new = cls(scaler._device, group=group, enabled=scaler.is_enabled())
        if scaler.is_enabled():
            new.load_state_dict(scaler.state_dict())
        return new

    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self.is_enabled():
            self._agree_on_found_inf(optimizer)

    @override
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The path of optimizers that unscale inside their own step (``_step_supports_amp_scaling``).
        super()._check_inf_per_device(optimizer)
        return self._agree_on_found_inf(optimizer)

    @override
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: Tensor,
        found_inf: Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, Tensor]:
        """Unscale and check local tensors, grouped by device and dtype for the foreach kernel.

        Unscaling is linear, so it is exact on shards and on ``Partial`` addends alike; an
        inf or nan in any addend makes the sum non-finite too, so checking addends is exact.
        """
        per_device: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    if not allow_fp16 and local.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if local.is_sparse:
                        if local.dtype is torch.float16:
                            local = local.coalesce()
                            param.grad = local
                        local = local._values()
                    per_device[local.device][local.dtype].append(local)
            found_inf_per_device: dict[torch.device, Tensor] = {}
            for device, per_dtype in per_device.items():
                device_found_inf = found_inf.to(device, copy=True)
                device_inv_scale = inv_scale.to(device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grads, device_found_inf, device_inv_scale
                    )
                found_inf_per_device[device] = device_found_inf
        return found_inf_per_device

    def _agree_on_found_inf(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        """All-reduce (MAX) the found-inf flags of ``optimizer`` over ``group``: one collective.

        A rank without any gradient still gets a zero flag and joins the collective, so it
        neither hangs the others nor trips GradScaler's "no inf checks" assertion.
        """
        state = self._per_optimizer_states[id(optimizer)]
        found_inf_per_device: dict[torch.device, Tensor] = state["found_inf_per_device"]
        assert self._scale is not None
        if not found_inf_per_device:
            found_inf_per_device[self._scale.device] = torch.zeros(
                (), dtype=torch.float32, device=self._scale.device
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            devices = list(found_inf_per_device)
            flags = torch.stack([found_inf_per_device[device].to(self._scale.device) for device in devices])
            flag = flags.max().reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            for device in devices:
                found_inf_per_device[device].copy_(flag[0])
        return found_inf_per_device
