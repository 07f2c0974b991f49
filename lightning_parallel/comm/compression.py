"""Gradient compression on the data-parallel all-reduce: bf16/fp16 casts and PowerSGD.

- ``"bf16"`` / ``"fp16"``: each gradient bucket is cast down, all-reduced (half the bytes),
  and cast back (torch's ``bf16_compress_hook`` / ``fp16_compress_hook``).
- :class:`PowerSGD` (Vogels et al. 2019): each gradient matrix ``M`` (n x m) is sent as two
  rank-``r`` factors ``P`` (n x r) and ``Q`` (m x r), ``(n + m) r`` numbers instead of ``n m``;
  what the approximation leaves out is added to the next step's gradient (error feedback).
  Vectors (biases, norms) and matrices too small to gain ``min_compression_rate`` are
  all-reduced as they are. torch's ``powerSGD_hook`` does the work, with one
  ``PowerSGDState`` (errors, warm-started factors) per communication unit.

Where the data-parallel all-reduce lives decides how the compression is installed:

- plain data parallelism (torch's composable DDP, ``replicate``): ``register_comm_hook`` on
  each replicated unit (:func:`register_ddp_compression`);
- pipeline parallelism: the runner's own bucketed all-reduce calls :class:`BucketCompressor`
  with each flattened bucket (the same torch hooks, given the bucket DDP would give them);
- tensor parallelism without pipeline stages: FSDP2's ``replicate`` reduces gradients and
  takes no communication hook, so the strategy refuses the combination at construction.

Bytes are counted by :func:`count_all_reduce_bytes` (the payload handed to each all-reduce
call made from Python, per process); DDP's uncompressed C++ reducer does not go through it,
and its payload is :func:`gradient_bytes`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.distributed.tensor import DTensor

from lightning_parallel.compat import compress_hook

__all__ = [
    "CASTS",
    "BucketCompressor",
    "PowerSGD",
    "count_all_reduce_bytes",
    "gradient_bytes",
    "powersgd_payload_bytes",
    "register_ddp_compression",
]

CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PowerSGD:
    """PowerSGD settings (``gradient_compression=PowerSGD(rank=4)``; ``"powersgd"`` is the defaults).

    Args:
        rank: rank ``r`` of the approximation of each gradient matrix.
        start_iter: optimizer steps of plain all-reduce before compressing (torch needs >= 2
            with error feedback; PowerSGD's authors warm up for about 10% of training).
        min_compression_rate: a matrix is compressed only if ``n m > rate (n + m) r``.
        warm_start: reuse last step's ``Q`` as the starting point (one power iteration per step).
    """

    rank: int = 4
    start_iter: int = 2
    min_compression_rate: float = 2.0
    warm_start: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"`PowerSGD(rank={self.rank!r})`: the rank must be a positive integer.")
        if not isinstance(self.start_iter, int) or self.start_iter < 2:
            raise ValueError(
                f"`PowerSGD(start_iter={self.start_iter!r})`: torch's PowerSGD with error feedback needs at"
                " least 2 steps of plain all-reduce first; use start_iter >= 2."
            )

    def state(self, group: dist.ProcessGroup | None) -> PowerSGDState:
        return PowerSGDState(
            process_group=group,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.start_iter,
            min_compression_rate=self.min_compression_rate,
            use_error_feedback=True,
            warm_start=self.warm_start,
            random_seed=0,
        )


GradientCompression = str | PowerSGD


def half_precision_hook(dtype: torch.dtype) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
    """torch's compress hook for ``dtype`` (mean computed in ``dtype``, result cast back in place).

    A function of its own: DDP refuses torch's ``bf16_compress_hook`` *by name* unless CUDA and
    NCCL are present, although gloo all-reduces bf16 tensors; the computation is torch's.
    """

    def half_precision_all_reduce(group, bucket):  # type: ignore[no-untyped-def]
        return compress_hook(dtype, group, bucket)

    # DDP checks the hook's annotations as objects (this module's are strings): give it those.
    half_precision_all_reduce.__annotations__ = {
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return half_precision_all_reduce


def register_ddp_compression(units: Iterable[nn.Module], compression: GradientCompression, group: Any) -> int:
    """Register the compression hook on each DDP-replicated unit; returns how many."""
    count = 0
    for unit in units:
        if isinstance(compression, PowerSGD):
            unit.register_comm_hook(compression.state(group), powerSGD_hook)
        else:
            unit.register_comm_hook(group, half_precision_hook(CASTS[compression]))
        count += 1
    return count


class _Bucket:
    """What torch's DDP communication hooks read from a ``dist.GradBucket``, for a flat buffer."""

    def __init__(self, index: int, flat: torch.Tensor, shapes: list[torch.Size], *, last: bool) -> None:
        self._index, self._flat, self._last = index, flat, last
        self._views, offset = [], 0
        for shape in shapes:
            numel = shape.numel()
            self._views.append(flat[offset : offset + numel].view(shape))
            offset += numel

    def buffer(self) -> torch.Tensor:
        return self._flat

    def index(self) -> int:
        return self._index

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return self._views


@dataclass
class BucketCompressor:
    """Compressed average of flattened gradient buckets over a data-parallel group (pipeline path)."""

    compression: GradientCompression
    states: dict[Any, PowerSGDState] = field(default_factory=dict)

    def all_reduce_mean(
        self,
        flat: torch.Tensor,
        shapes: list[torch.Size],
        group: dist.ProcessGroup,
        index: int,
        *,
        last: bool,
    ) -> None:
        """Average ``flat`` (the concatenated gradients of ``shapes``) over ``group``, in place."""
        bucket = _Bucket(index, flat, shapes, last=last)
        if isinstance(self.compression, PowerSGD):
            state = self.states.setdefault(group, self.compression.state(group))
            result = powerSGD_hook(state, bucket).wait()  # type: ignore[arg-type]
        else:
            result = half_precision_hook(CASTS[self.compression])(group, bucket).wait()
        if result.data_ptr() != flat.data_ptr():
            flat.copy_(result)


def gradient_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes an uncompressed all-reduce sends per step: every trainable parameter's (local) gradient."""
    total = 0
    for p in parameters:
        if p.requires_grad:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total


def powersgd_payload_bytes(shapes: Iterable[torch.Size], config: PowerSGD, element_size: int = 4) -> int:
    """Bytes PowerSGD sends for gradients of these shapes in one compressed step (torch's rule)."""
    total = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = shape.numel() // n if n else 0
        r = min(n, m, config.rank)
        if len(shape) > 1 and (n + m) * r * config.min_compression_rate < n * m:
            total += (n + m) * r
        else:
            total += shape.numel()
    return total * element_size


@dataclass
class AllReduceLog:
    """Payload bytes of each ``torch.distributed.all_reduce`` call made from Python."""

    calls: list[int] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(self.calls)

    def clear(self) -> None:
        self.calls.clear()


@contextmanager
def count_all_reduce_bytes() -> Iterator[AllReduceLog]:
    """Count the payload of every ``torch.distributed.all_reduce`` called from Python inside (a measurement tool)."""
    log = AllReduceLog()
    original: Callable[..., Any] = dist.all_reduce

    @functools.wraps(original)
    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        log.calls.append(local.numel() * local.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        yield log
    finally:
        dist.all_reduce = original  # type: ignore[assignment]
