"""A one-process simulation of PowerSGD over N ranks, to check what the distributed run sent.

The run records, for every bucket its compression hook was called with, each rank's input
gradient buffer and the buffer it got back (:class:`HookRecorder`). :func:`simulate` then feeds
the same inputs to torch's own ``powerSGD_hook`` for N virtual ranks in one process, one thread
per rank, their all-reduces met by a barrier instead of a process group: the same compressor
(same ranks, same per-rank error feedback and warm-started factors, same random seeds), with
none of the run's communication, buckets glue or state handling. :func:`compression_problems`
compares the two within fp32 tolerance: a compressor returning zeros, stale factors, a lost
error feedback or a wrong divisor fails it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

from lightning_parallel import PowerSGD
from tests.distributed.cases import ATOL, RTOL
from tests.distributed.harness import mismatch

__all__ = ["BucketCall", "HookRecorder", "compressor", "compression_problems", "simulate"]


@dataclass
class BucketCall:
    """One hook call on one rank: which unit's state, the bucket, its input and what came back."""

    unit: int
    index: int
    last: bool
    shapes: list[list[int]]
    offsets: list[int]  # of each gradient in the bucket's buffer (DDP's layout is not always in order)
    before: torch.Tensor
    after: torch.Tensor | None = None


@dataclass
class HookRecorder:
    """Wraps a communication hook ``(state, bucket) -> Future`` and records every call (one rank)."""

    hook: Callable[[Any, Any], torch.futures.Future]
    calls: list[BucketCall] = field(default_factory=list)
    _units: dict[int, int] = field(default_factory=dict)

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future:
        call = BucketCall(
            unit=self._units.setdefault(id(state), len(self._units)),
            index=bucket.index(),
            last=bucket.is_last(),
            shapes=[list(g.shape) for g in bucket.gradients()],
            offsets=[_offset_in(g, bucket.buffer()) for g in bucket.gradients()],
            before=bucket.buffer().detach().clone(),
        )
        self.calls.append(call)

        def keep(fut: torch.futures.Future) -> torch.Tensor:
            result = fut.value()
            result = result[0] if isinstance(result, list) else result
            call.after = result.detach().clone()
            return result

        return self.hook(state, bucket).then(keep)

    def as_hook(self) -> Callable[[Any, Any], torch.futures.Future]:
        """A plain function for ``register_comm_hook``, which checks a hook's annotations as objects."""

        def recorded(state, bucket):  # type: ignore[no-untyped-def]
            return self(state, bucket)

        recorded.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        return recorded

    def records(self) -> list[dict[str, Any]]:
        return [dict(vars(c)) for c in self.calls]


def _offset_in(view: torch.Tensor, buffer: torch.Tensor) -> int:
    """Where ``view`` starts in ``buffer`` (elements); they must share storage."""
    if view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        raise RuntimeError(
            "a bucket gradient is not a view of the bucket's buffer: the layout cannot be recorded"
        )
    return view.storage_offset() - buffer.storage_offset()


class _Bucket:
    """The part of ``dist.GradBucket`` the hook reads, over a recorded input."""

    def __init__(self, call: dict[str, Any]) -> None:
        self._flat = call["before"].clone()
        self._call = call
        self._views = [
            self._flat[offset : offset + torch.Size(shape).numel()].view(shape)
            for shape, offset in zip(call["shapes"], call["offsets"], strict=True)
        ]

    def buffer(self) -> torch.Tensor:
        return self._flat

    def index(self) -> int:
        return self._call["index"]

    def is_last(self) -> bool:
        return self._call["last"]

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        return self._views


class _VirtualGroup:
    """N ranks in one process: ``all_reduce`` from each rank's thread meets at a barrier.

    Only one rank's thread runs between all-reduces (``turn``): the hook seeds torch's global RNG
    and draws its random factors, which ranks in threads would otherwise interleave (each process
    of a real run has its own generator).
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[torch.Tensor | None] = [None] * size
        self.rank = threading.local()
        self.turn = threading.Lock()

    def size(self) -> int:
        return self._size

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._slots[self.rank.value] = tensor
        self.turn.release()
        try:
            self._barrier.wait()
            total = torch.stack([t for t in self._slots if t is not None]).sum(0)
            self._barrier.wait()  # every rank has read every slot before any is written
            tensor.copy_(total)
            self._barrier.wait()
        finally:
            self.turn.acquire()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([tensor])
        return _Done(future)


@dataclass
class _Done:
    future: torch.futures.Future

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> bool:
        return True


@contextmanager
def _all_reduce_through(group: _VirtualGroup) -> Iterator[None]:
    original = dist.all_reduce
    dist.all_reduce = group.all_reduce  # the hook module and torch's default hooks call dist.all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def compressor(config: PowerSGD | torch.dtype) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]:
    """torch's hook for a compression setting and how it makes its state from a group."""
    if isinstance(config, PowerSGD):
        return config.state, powerSGD_hook
    return (lambda group: group), functools.partial(default_hooks._compress_hook, config)


def simulate(config: PowerSGD | torch.dtype, ranks: list[list[dict[str, Any]]]) -> list[list[torch.Tensor]]:
    """What each rank's hook should have returned for each of its recorded calls, in one process.

    ``config``: a :class:`PowerSGD` (torch's ``powerSGD_hook``, one state per unit and rank) or a
    dtype (torch's cast-all-reduce-cast hook).
    """
    make_state, hook = compressor(config)
    size = len(ranks)
    group = _VirtualGroup(size)
    outputs: list[list[torch.Tensor]] = [[] for _ in range(size)]

    def run(rank: int) -> None:
        group.rank.value = rank
        states: dict[int, Any] = {}
        group.turn.acquire()
        try:
            for call in ranks[rank]:
                state = states.setdefault(call["unit"], make_state(group))
                result = hook(state, _Bucket(call)).wait()
                outputs[rank].append((result[0] if isinstance(result, list) else result).clone())
        except BaseException:
            group._barrier.abort()  # the other ranks' waits fail too, instead of hanging
            raise
        finally:
            group.turn.release()

    with _all_reduce_through(group), ThreadPoolExecutor(size) as pool:
        list(pool.map(run, range(size)))  # the first rank's exception, raised here
    return outputs


def compression_problems(config: PowerSGD | torch.dtype, ranks: list[list[dict[str, Any]]]) -> list[str]:
    """Where the run's returned buffers differ from the simulation's (fp32 tolerance); empty: equal."""
    if len({len(calls) for calls in ranks}) != 1:
        return [f"ranks made different numbers of hook calls: {[len(c) for c in ranks]}"]
    expected = simulate(config, ranks)
    problems = []
    for rank, calls in enumerate(ranks):
        for i, call in enumerate(calls):
            problem = mismatch(call["after"], expected[rank][i], RTOL, ATOL)
            if problem:
                problems.append(
                    f"rank {rank}, call {i} (unit {call['unit']}, bucket {call['index']}): {problem}"
                )
    return problems
