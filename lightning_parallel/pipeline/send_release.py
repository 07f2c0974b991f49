"""Pipeline sends let go once they complete, not when the step ends.

torch's runtime for the multi-stage schedules (interleaved 1F1B, looped BFS, the zero-bubble schedules,
DualPipe-V: ``_PipelineScheduleRuntime``) keeps every send's ``Work`` in a list it waits on only at the end
of the step, and a ``Work`` keeps the tensor it sends: each micro-batch's stage outputs and input gradients,
on every stage of the rank, stay alive until the step ends. Measured on two CPU ranks with two stages each
(``tests/strategy/test_memory_terms.py``): the peak grew by three hidden states per micro-batch under
interleaved 1F1B, two under ZB-V; on Llama 3 70B's interleaved layout (M = 64, five stages a rank, a hidden
state an fp32 sequence-parallel slice of 64 MiB) 576 of them, 36 GiB, by the step's end. Megatron waits on its
sends at the next exchange.

:class:`SendRelease` wraps, while a step runs, the schedule module's batching of point-to-point operations and
each stage's making of its forward sends, and lets a batch of sends go (waits on it, which raises a failed send's
error there, and empties it in place: torch's own list then holds an empty batch, which it waits on at the end
as before) at the first exchange after it is known complete:

- a stage's output sent for micro-batch m, once that stage has run m's backward: its gradient came back, so the
  next stage received the output (the output itself goes then, with the stage's forward cache);
- any batch whose every ``Work`` reports completion (NCCL's do as their kernels finish; gloo's only once
  waited on, so on a CPU the input gradients a stage sends stay until the step's end, as in torch).

A batch already reported complete is not waited on again (gloo's sends hang on a second wait), and nothing is
waited on before it is known complete, so no rank blocks on a peer that has not posted its receive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules

__all__ = ["SendRelease"]

_BATCH = "_batch_p2p"  # torch.distributed.pipelining.schedules', on torch 2.13 (feature-detected)


class SendRelease:
    """Lets a pipelined step's sends go once complete, under torch's runtime for the multi-stage schedules.

    The single-stage schedules (GPipe, 1F1B) wait on their sends themselves, 1F1B at once; GPipe copies the
    ``Work`` objects into lists of its own and waits on them again, which on gloo would hang after a wait here:
    the runner leaves those schedules alone (``enabled`` False, also the tests' negative control)."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.released = 0  # send batches let go before their step's end, over the run
        self._pending: list[tuple[list[Any], _Sent | None]] = []
        self._sent: dict[int, _Sent] = {}  # id of a forward send's P2POp -> its stage and micro-batch

    @contextmanager
    def during_step(self, stages: Sequence[Any]) -> Iterator[None]:
        original = getattr(torch_schedules, _BATCH, None)
        if not self.enabled or original is None:
            yield
            return
        setattr(torch_schedules, _BATCH, self._wrap(original))
        for stage in stages:
            stage.get_fwd_send_ops = self._tagging(stage)
        try:
            yield
        finally:
            setattr(torch_schedules, _BATCH, original)
            for stage in stages:
                del stage.get_fwd_send_ops  # the class's method again
            self._pending, self._sent = [], {}  # torch has waited on all of them at its step's end

    def _tagging(self, stage: Any) -> Callable[[int], list[dist.P2POp]]:
        make = type(stage).get_fwd_send_ops

        def get_fwd_send_ops(fwd_chunk_id: int) -> list[dist.P2POp]:
            ops = make(stage, fwd_chunk_id)
            for op in ops:
                self._sent[id(op)] = _Sent(stage, fwd_chunk_id, op)
            return ops

        return get_fwd_send_ops

    def _wrap(self, original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def batch_p2p(p2p_ops: list[dist.P2POp], *args: Any, **kwargs: Any) -> list[Any]:
            self._sweep()
            works = original(p2p_ops, *args, **kwargs)
            if p2p_ops and all(op.op is dist.isend for op in p2p_ops) and isinstance(works, list):
                forward = [self._sent.pop(id(op), None) for op in p2p_ops]
                self._pending.append((works, forward[0] if len(forward) == 1 else None))
            return works

        return batch_p2p

    def _sweep(self) -> None:
        waiting = []
        for works, forward in self._pending:
            completed = all(work.is_completed() for work in works)
            if completed or (forward is not None and forward.answered()):
                # gloo's: done, but reported so only once waited on (a second wait would hang)
                if not completed:
                    for work in works:
                        work.wait()
                works.clear()  # the list torch keeps: its Works, and the tensors they hold, go now
                self.released += 1
            else:
                waiting.append((works, forward))
        self._pending = waiting


class _Sent:
    """A stage's output sent for one micro-batch."""

    __slots__ = ("stage", "micro_batch", "op")

    def __init__(self, stage: Any, micro_batch: int, op: dist.P2POp) -> None:
        self.stage, self.micro_batch, self.op = stage, micro_batch, op  # the op kept: its id stays unique

    def answered(self) -> bool:
        """The stage ran the micro-batch's backward (torch pops its forward cache then): the gradient of this
        output came back from the next stage, which therefore had received the output."""
        return self.micro_batch not in self.stage.fwd_cache
