"""DeepSpeed's CPU Adam on the shards FSDP2 offloads to the CPU (``offload="cpu"`` on the FSDP2 engine).

DeepSpeed's vectorised kernel reads plain tensors by address; FSDP2's parameters, their gradients
and states made like them are DTensors, which it cannot take (measured on these machines: a crash).
The DTensors stay the optimizer's parameters and states, so everything keyed by them is unchanged:
distributed checkpoint's optimizer state dict, the gradient-norm clipping over the optimizer's
parameters, LR schedulers. Only the kernel call sees each rank's local shard, which shares storage
with its DTensor, so the update lands in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from lightning_parallel.zero.fsdp import KEPT_ON_DEVICE


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard (a view of the DTensor's storage under ``no_grad``)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def offloaded(param: torch.Tensor) -> bool:
    """Whether the kernel steps ``param``: a shard on the CPU that partial offload did not keep on the device
    (``zero/fsdp.py``: ``KEPT_ON_DEVICE``; on a CPU-only machine those are on the CPU too)."""
    return param.device.type == "cpu" and not getattr(param, KEPT_ON_DEVICE, False)


def torch_adam_refusal(optimizer: Any) -> str | None:
    """Why torch's fused Adam cannot step ``optimizer``'s host shards in its place (None: it can): the overlapped
    and the delayed host steps (``zero/overlapped_step.py``, ``zero/delayed_update.py``) both run it."""
    if type(optimizer) is not ShardedCPUAdam:  # the NVMe subclass keeps its states in files
        return f"{type(optimizer).__name__}, not Adam/AdamW on the host's shards"
    if not all(group["bias_correction"] for group in optimizer.param_groups):
        return "bias_correction=False (torch's Adam always corrects the bias)"
    dtype = next(
        (p.dtype for g in optimizer.param_groups for p in g["params"] if p.dtype != torch.float32), None
    )
    if dtype is not None:  # precision="bf16-true"
        return f"{dtype} parameters with fp32 states (torch's fused Adam takes one dtype; DeepSpeed's kernel both)"
    return None


def adam_on(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hyper: Mapping[str, Any],
    *,
    decoupled: bool,
    fused: bool,
) -> None:
    """Torch's functional Adam on plain tensors, in place; each ``steps`` entry is counted up by one first (as
    in ``torch.optim.Adam``). ``decoupled``: AdamW's weight decay."""
    beta1, beta2 = hyper["betas"]
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        fused=fused,
        foreach=False,
        decoupled_weight_decay=decoupled,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=hyper["lr"],
        weight_decay=hyper["weight_decay"],
        eps=hyper["eps"],
        maximize=False,
    )


def split_by_offload(group: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters of ``group`` with a gradient: (offloaded ones the kernel steps, the ones on the device)."""
    with_grad = [p for p in group["params"] if p.grad is not None]
    return [p for p in with_grad if offloaded(p)], [p for p in with_grad if not offloaded(p)]


class ShardedCPUAdam(DeepSpeedCPUAdam):
    """``DeepSpeedCPUAdam`` whose parameters may be DTensors on the CPU: the kernel runs on their local shards."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_parameters()
        return loss

    def _step_parameters(self) -> None:
        """The update of every parameter with a gradient: the kernel for the offloaded, torch's Adam for the rest;
        none that :meth:`step_in_backward` stepped already in this step's backward."""
        deferred = vars(self).get("deferred_update")
        if deferred is not None:  # offload_update="delayed" or an importance split: the update's own rule
            deferred.launch()
            return
        early = vars(self).pop("_stepped_in_backward", set())
        for group in self.param_groups:
            kernel, on_device = split_by_offload(group)
            for param in (p for p in kernel if id(p) not in early):
                state = self._state_of(param)
                state["step"] += 1
                self._kernel_update(group, param, state["step"], state["exp_avg"], state["exp_avg_sq"])
            self._step_on_device(group, on_device)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroing in place waits for a deferred update's worker, which may still read this step's gradients (set to
        None, they stay alive for it)."""
        # through Lightning's wrapper too
        deferred = vars(getattr(self, "_optimizer", self)).get("deferred_update")
        if deferred is not None and not set_to_none:
            deferred.wait()
        super().zero_grad(set_to_none)

    @torch.no_grad()  # a worker thread: grad mode is per thread
    def step_in_backward(self, param: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """One offloaded parameter's update while backward still runs (``zero/overlapped_step.py``), then skipped
        by this step's :meth:`step`: torch's fused CPU Adam, which releases the GIL (DeepSpeed's kernel holds it,
        and the backward's Python hooks would wait for it), on the local shards, with the same states."""
        groups = vars(self).get("_group_of")
        if groups is None or id(param) not in groups:
            groups = {id(p): group for group in self.param_groups for p in group["params"]}
            vars(self)["_group_of"] = groups
        # the gradient the hook saw final (read on the main thread)
        grad = param.grad if grad is None else grad
        self.torch_adam(groups[id(param)], [param], [grad], fused=True)
        vars(self).setdefault("_stepped_in_backward", set()).add(id(param))

    def _kernel_update(
        self,
        group: dict[str, Any],
        param: torch.Tensor,
        step: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
    ) -> None:
        """DeepSpeed's vectorised Adam on the local shards of ``param``, its gradient and its states, in place."""
        beta1, beta2 = group["betas"]
        tensors = [_local(t) for t in (param, param.grad, exp_avg, exp_avg_sq)]
        updated = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        self.ds_opt_adam.adam_update(
            self.opt_id,
            int(step),
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            group["bias_correction"],
            *updated,
        )
        for original, copy in zip(tensors, updated, strict=True):
            if copy is not original:
                original.copy_(copy)

    def _state_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float if self.fp32_optimizer_states else param.dtype

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            dtype = self._state_dtype(param)
            state["step"] = torch.tensor(0.0)  # as torch's Adam: checkpoints interchangeable with it
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype)
        return state

    def _step_on_device(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """Torch's Adam for the parameters FSDP2 does not offload (the vectors tensor parallelism cuts,
        which it leaves whole over ``dp``; parameters of the LightningModule itself; the units partial
        offload keeps on the device): same update, same state keys, on their device."""
        if not params:
            return
        if not group["bias_correction"]:
            raise ValueError(
                f"{type(self).__name__}(bias_correction=False): parameters FSDP2 keeps on {params[0].device} are"
                " stepped by torch's Adam, which always corrects the bias. Leave bias_correction=True."
            )
        self.torch_adam(group, params, [p.grad for p in params])

    @torch.no_grad()
    def torch_adam(
        self,
        hyper: Mapping[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        into: list[torch.Tensor] | None = None,
        *,
        fused: bool = False,
    ) -> None:
        """Torch's Adam with this optimizer's states and rule on ``params``' local shards (``hyper``: their group's
        hyper-parameters), written into them or into ``into`` (copies: the delayed update). ``fused``: torch's
        fused CPU kernel, which releases the GIL (one dtype for parameters and states)."""
        states = [self._state_of(p) for p in params]
        adam_on(
            into if into is not None else [_local(p) for p in params],
            [_local(g) for g in grads],
            [_local(s["exp_avg"]) for s in states],
            [_local(s["exp_avg_sq"]) for s in states],
            [s["step"] for s in states],
            hyper,
            decoupled=self.adam_w_mode,
            fused=fused,
        )

    def __del__(self) -> None:
        # Lightning wraps each optimizer in a ``LightningOptimizer`` that subclasses it and forwards attribute
        # reads to it: when a wrapper dies, DeepSpeed's ``__del__`` would destroy the kernel's state of the
        # optimizer it wraps (``destroy_adam(opt_id)``), and the next step reads freed memory (measured: a
        # segfault). Only the object that created the state destroys it.
        if "ds_opt_adam" in vars(self):
            super().__del__()
