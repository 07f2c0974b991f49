"""The host optimizer step of offloaded shards, started while backward still runs.

ZeRO-Offload as DeepSpeed runs it waits for the whole backward, then steps every shard on the host:
the device idles for the whole CPU step (on one H200, GPT-1.3B bf16: DeepSpeed's ZeRO-2 offload 3.2x
plain eager). Adam updates each tensor from its own gradient and states alone, so a shard whose
gradient is final can be stepped at once, exactly as after backward, while the device computes the
gradients of the layers below.

FSDP2 tells when a gradient is final: after a unit's reduce-scatter (and, offloaded, its copy to
host memory) it calls the post-accumulate-grad hooks of each sharded parameter (torch's
"optimizer in backward" contract). On torch 2.13 that copy is synchronous when such a hook exists;
torch 2.11 leaves it in flight into pinned memory on a GPU (its event waited for only at the end of
backward), so the worker waits for that event before it reads the gradient: read early, it would
step on a gradient half copied, on the GPU alone. The hook queues the parameter to one worker thread,
which steps it with torch's fused CPU Adam: that kernel releases the GIL, so the backward's
Python hooks keep running beside it (DeepSpeed's CPU Adam holds the GIL for the whole call,
measured here: a Python thread beside it stalls). The rest of the optimizer (parameters kept on
the device, those reduced after backward) steps as before, in ``optimizer.step()``.

Exact only when the step needs nothing global, so the strategy arms it only then: no gradient
clipping (the global norm exists only after the whole backward), no loss scale (an overflow
anywhere skips every update), the backward the last of the step (not an accumulating one), each
gradient reduced once per step (not ``zero_reshard="micro_batch"``). Parameters whose gradients
are changed after backward (weights tied across pipeline stages, vectors reduced by hand) are
never hooked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_parallel.compat import fsdp_grad_copy_event

__all__ = ["HostStepSpan", "OverlappedHostStep", "overlap_refusal"]


@dataclass(frozen=True)
class HostStepSpan:
    """One parameter's host step: its name and when it ran (``time.perf_counter()`` seconds)."""

    name: str
    start: float
    end: float


class OverlappedHostStep:
    """Steps ``params`` (name -> offloaded sharded parameter) of ``optimizer`` as backward finishes them.

    ``optimizer`` is a :class:`~lightning_parallel.zero.sharded_cpu_adam.ShardedCPUAdam`: its
    ``step_in_backward(param)`` updates one parameter and marks it, its ``step()`` the others. ``shards``
    (``zero.fsdp.shard_states``) gives each parameter's ``FSDPParam``, whose gradient copy may be in flight.
    """

    def __init__(
        self, optimizer: Any, params: dict[str, nn.Parameter], shards: dict[int, Any] | None = None
    ) -> None:
        self.optimizer = optimizer
        self._names = {id(p): name for name, p in params.items()}
        self._shards = shards or {}  # id(param) -> FSDP2's FSDPParam: the gradient copy's event (torch 2.11)
        unknown = [name for name, p in params.items() if shards is not None and id(p) not in shards]
        if unknown:  # a hook that could not wait for its copy would step on half-copied gradients on a GPU
            raise RuntimeError(f"offloaded parameters FSDP2 does not manage as shards: {unknown}")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lp-host-step")
        self._futures: list[Future[HostStepSpan]] = []
        self._lock = threading.Lock()
        self._armed = False
        self.spans: list[HostStepSpan] = []
        """The host steps of the last armed backward, in the order they ran."""
        self.backward_end: float | None = None
        """When the last armed backward returned (``time.perf_counter()``)."""
        self.stepped_in_backward = 0
        """Parameter steps run during backward, over the whole run (the engagement record reads it)."""
        self.begun_before_backward_end = 0
        """Of those, the ones that started before their backward returned (timestamps), over the whole run."""
        self.waited_for_copies = 0
        """Host steps that first waited for their gradient's copy to host memory (torch 2.11 on a GPU)."""
        self._handles = [p.register_post_accumulate_grad_hook(self._gradient_final) for p in params.values()]

    @property
    def parameters(self) -> int:
        return len(self._names)

    def name_of(self, param: torch.Tensor) -> str:
        """The user's name of a parameter this step hooks (the timeline's names)."""
        return self._names[id(param)]

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Around one optimizer step: its backward queues each finished parameter; always disarmed after."""
        self._armed = True
        self.spans = []
        try:
            yield
        finally:
            self._armed = False
            self.finish()

    def _gradient_final(self, param: torch.Tensor) -> None:
        grad = param.grad  # read here, on the thread that made it final: the worker may run after the main
        if not self._armed or grad is None:  # thread has moved on (a zero-bubble schedule's next pass)
            return
        shard = self._shards.get(id(param))
        copy = fsdp_grad_copy_event(shard) if shard is not None else None  # now: FSDP2 replaces it later
        with self._lock:
            self._futures.append(self._pool.submit(self._step, param, grad, copy))

    def _step(self, param: torch.Tensor, grad: torch.Tensor, copy: Any = None) -> HostStepSpan:
        start = time.perf_counter()
        if copy is not None:  # on the worker: backward's thread goes on launching kernels meanwhile
            copy.synchronize()
            with self._lock:
                self.waited_for_copies += 1
        self.optimizer.step_in_backward(param, grad)
        return HostStepSpan(self._names[id(param)], start, time.perf_counter())

    def finish(self) -> None:
        """After backward: wait for the queued host steps (re-raising a failure) before anything reads them."""
        with self._lock:
            futures, self._futures = self._futures, []
        for future in futures:
            self.spans.append(future.result())
        self.stepped_in_backward += len(futures)

    def end_of_backward(self) -> None:
        """Called when the armed step's backward returns: stamps the time, then waits for the host steps."""
        if self._armed:
            self.backward_end = end = time.perf_counter()
            self.finish()
            self.begun_before_backward_end += sum(span.start < end for span in self.spans)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._pool.shutdown(wait=True)


def overlap_refusal(
    optimizer: Any,
    *,
    gradient_clip_val: float | None,
    clipping_overridden: bool,
    loss_scaled: bool,
    reduced_per_micro_batch: bool,
) -> str | None:
    """Why the host step cannot start during backward in this run (None: it can), as the setup log says it."""
    from lightning_parallel.zero.sharded_cpu_adam import (
        torch_adam_refusal,  # imports DeepSpeed: only with offload
    )

    if (refusal := torch_adam_refusal(optimizer)) is not None:
        return refusal
    if gradient_clip_val:
        return f"gradient_clip_val={gradient_clip_val} clips by the global norm, known only after the whole backward"
    if clipping_overridden:
        return "the LightningModule's configure_gradient_clipping may change gradients after backward"
    if loss_scaled:
        return "16-mixed's loss scale skips every update when any gradient overflows"
    if reduced_per_micro_batch:
        return "zero_reshard='micro_batch' reduces every micro-batch's gradients, not once per step"
    return None
