"""Pipeline receive buffers for the micro-batches in flight only (torch allocates one per micro-batch).

torch's ``PipelineStage`` makes, when a schedule first runs, one receive buffer per micro-batch and keeps
them for the whole run: the activation each stage after the first receives, and the gradient each stage
before the last receives. That is M hidden states (twice on middle stages) whatever the schedule keeps
in flight: GPT-530B on 35 stages with 280 micro-batches, 2.7 GiB of a rank; Llama-3-70B interleaved, 18 GiB.
Megatron receives into tensors it allocates per transfer and frees after the micro-batch's backward.

:class:`ReceiveBuffers` does that for a stage. At setup torch's buffers are made empty placeholders (the
factory it calls is swapped for one that records what it would have made); the buffer is made when its
receive is posted and let go when its micro-batch no longer needs it: after the micro-batch's backward
(under the zero-bubble schedules, after its weight pass, which still reads the stage's input). So a
stage holds as many buffers as the schedule has receives outstanding or micro-batches in flight (1F1B on
stage s: P - s activations and one gradient). The memory is the allocator's to reuse (on a GPU its
cache); the tensor is a new one each time, because a storage reused while the step runs would be taken
for the previous micro-batch's by whatever knows a saved tensor by its storage (the activation offload,
the counter: a pool did that, and offload restored one micro-batch's input for another). What the
schedule passes between two stages of one rank (the V schedules) is the other stage's tensor, not a
buffer; it is let go at the same moment.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.pipelining import stage as torch_stage

from lightning_parallel.pipeline.schedule_actions import rank_actions
from lightning_parallel.pipeline.schedules import ScheduleSpec

__all__ = ["ReceiveBuffers", "buffers_in_flight", "receive_buffer_bytes"]

_FACTORY = "_make_tensor_from_meta"  # torch.distributed.pipelining.stage's, on torch 2.11 and 2.13


class ReceiveBuffers:
    """The receive buffers of one stage: placeholders between uses, a fresh buffer while a micro-batch needs one."""

    enabled: bool = True
    """Off (per stage, before its first step): torch's one buffer per micro-batch (the tests' negative control)."""

    def __init__(self) -> None:
        self._templates: dict[int, tuple[torch.Tensor, Callable[..., torch.Tensor], Any, Any]] = {}
        self._home: dict[int, tuple[Any, torch.Tensor]] = {}  # id(recv info) -> (info, its placeholder)
        self._live: dict[int, torch.Tensor] = {}  # id(buffer in use) -> the buffer
        self.peak = 0
        """Most buffers held at once, over the run."""
        self.peak_bytes = 0
        """Most bytes of buffers held at once, over the run."""

    # ---- setup: torch makes placeholders -------------------------------------------------

    @contextmanager
    def placeholders(self) -> Iterator[None]:
        """While torch prepares a stage's receive information: empty placeholders instead of buffers."""
        if not self.enabled:
            yield
            return
        original = getattr(torch_stage, _FACTORY)

        def placeholder(meta: Any, device: Any) -> torch.Tensor:
            made = torch.empty(0, dtype=meta.dtype, device=device)
            self._templates[id(made)] = (made, original, meta, device)
            return made

        setattr(torch_stage, _FACTORY, placeholder)
        try:
            yield
        finally:
            setattr(torch_stage, _FACTORY, original)

    def adopt(self, infos: Iterable[Any]) -> None:
        """Remember each receive information's placeholder (after torch made them)."""
        for info in infos:
            buffer = getattr(info, "buffer", None)
            if isinstance(buffer, torch.Tensor) and id(buffer) in self._templates:
                self._home[id(info)] = (info, buffer)

    # ---- while the schedule runs ---------------------------------------------------------

    def take(self, infos: Iterable[Any]) -> None:
        """A receive is about to be posted into ``infos``: real buffers in place of their placeholders."""
        for info in infos:
            home = self._home.get(id(info))
            if home is None or info.buffer is not home[1]:
                continue
            placeholder = home[1]
            _, factory, meta, device = self._templates[id(placeholder)]
            # the buffer torch would have made, but contiguous: a point-to-point receive needs that (a hidden
            # state made by a transpose keeps its strides)
            buffer = factory(meta, device)
            if not buffer.is_contiguous():
                buffer = torch.empty(buffer.shape, dtype=buffer.dtype, device=buffer.device)
            buffer.requires_grad_(placeholder.requires_grad)  # torch 2.11 marks its buffers at creation
            self._live[id(buffer)] = buffer
            info.buffer = buffer
            self.peak = max(self.peak, len(self._live))
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def give_back(self, infos: Iterable[Any]) -> None:
        """The micro-batch of ``infos`` is done: its buffers are let go, the placeholders back in their place."""
        for info in infos:
            home = self._home.get(id(info))
            if home is None or info.buffer is home[1]:
                continue
            buffer = info.buffer  # ours, or what a stage of this rank passed (V schedules): let go of both
            info.buffer = home[1]
            ours = self._live.pop(id(buffer), None) if isinstance(buffer, torch.Tensor) else None
            if ours is not None:  # its memory now: the schedule's finished receive op still holds the tensor
                with torch.no_grad():
                    ours.grad = None
                    ours.requires_grad_(False)
                    ours.set_()

    @property
    def held_bytes(self) -> int:
        """Bytes of the buffers in use now."""
        return sum(_nbytes(b) for b in self._live.values())


def _key(meta: Any, device: Any) -> tuple:
    """Buffers of equal shape, strides, dtype and device serve each other (torch 2.13 describes a buffer with
    a ``_TensorMeta``, 2.11 with an example tensor)."""
    shape = getattr(meta, "shape", None)
    stride = getattr(meta, "stride", None)
    return (
        tuple(shape if shape is not None else meta.size()),
        stride if isinstance(stride, tuple) else None,
        meta.dtype,
        str(torch.device(device)),
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def receive_buffer_bytes(stage: Any) -> int:
    """Bytes a stage's receive buffers hold now, with the gradients torch leaves on them: between steps torch's
    own stage holds one per micro-batch; with :class:`ReceiveBuffers`, none (its peak is ``peak_bytes``)."""
    seen: dict[int, int] = {}
    for recv_info in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
        for info in _all(recv_info):
            for tensor in (
                getattr(info, "buffer", None),
                getattr(getattr(info, "buffer", None), "grad", None),
            ):
                if isinstance(tensor, torch.Tensor) and tensor.numel():
                    seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def _all(recv_info: dict[int, Any]) -> Iterator[Any]:
    for infos in recv_info.values():
        yield from infos


def buffers_in_flight(
    spec: ScheduleSpec, pipeline_parallel: int, virtual_stages: int, micro_batches: int
) -> list[int]:
    """Receive buffers each stage holds at once with reuse (by stage index): the planner's count.

    GPipe: every activation a stage receives is in flight before the first backward (M), one gradient at a
    time. 1F1B: ``P - s`` activations on stage s, one gradient. The multi-stage schedules: counted on torch's
    own action list for the layout (a buffer from its receive to its micro-batch's backward, or weight pass),
    built with stand-in stages; where that fails (another torch), the stage's in-flight micro-batches and one.
    """
    p, m, n = pipeline_parallel, micro_batches, pipeline_parallel * virtual_stages
    if not spec.multi_stage:
        held = [m if spec.name == "gpipe" else min(p - s, m) for s in range(n)]
        return [held[s] * (s > 0) + (s < n - 1) for s in range(n)]
    try:
        return list(_simulated(spec, p, virtual_stages, m))
    except Exception:  # noqa: BLE001 - an estimate is better than no plan
        return [min(m, 2 * p) * (s > 0) + (s < n - 1) for s in range(n)]


@functools.lru_cache(maxsize=256)
def _simulated(spec: ScheduleSpec, p: int, v: int, m: int) -> list[int]:
    held, peak = [0] * (p * v), [0] * (p * v)
    live: set[tuple[int, int, str]] = set()
    for actions in rank_actions(spec, p, v, m):  # torch orders every rank's actions, comms included
        for kind, s, mb in actions:
            if kind in ("RECV_F", "RECV_B"):
                live.add((s, mb, kind))
                held[s] += 1
                peak[s] = max(peak[s], held[s])
            elif kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT"):
                for recv in ("RECV_F", "RECV_B"):
                    if (s, mb, recv) in live:
                        live.discard((s, mb, recv))
                        held[s] -= 1
    return peak
