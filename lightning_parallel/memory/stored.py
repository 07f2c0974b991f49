"""One storage of saved activations as the saver keeps it: compressed (bf16, fp8) and/or in host memory.

The formats and their rounding (``compress``/``decompress``), the pinned host buffers reused from step to
step, and ``_StoredStorage``, shared by every saved view of one storage (``q``, ``k`` and ``v`` of one fused
projection), so that nothing is compressed or copied twice. The saved-tensor hooks that decide what goes
where are ``saved_tensors.py``'s.
"""

from __future__ import annotations

import weakref
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

__all__ = ["COMPRESSIONS", "Compression", "HostBuffers", "compress", "decompress"]

Compression = Literal["bf16", "fp8"]
COMPRESSIONS: tuple[str, ...] = ("bf16", "fp8")
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)


def compress(tensor: torch.Tensor, kind: Compression) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(stored, scale)`` for a floating-point tensor worth compressing, else ``None``."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    if kind == "bf16":
        if tensor.element_size() <= 2:
            return None
        return tensor.to(torch.bfloat16), None
    if tensor.element_size() <= 1:
        return None
    # Finite values only: a storage may hold bytes no saved view covers (never read back).
    amax = torch.nan_to_num(tensor.detach().abs().float(), nan=0.0, posinf=0.0).amax()
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    return (tensor.float() / scale).to(_FP8), scale


def decompress(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return stored.to(dtype)
    return (stored.float() * scale.to(stored.device)).to(dtype)


class HostBuffers:
    """Host buffers for offloaded storages, reused across steps (pinned allocations are slow).

    A buffer comes back to the pool when the storage that used it is garbage (its backward is done).
    On a GPU every copy into or out of a buffer runs on the saver's one side stream, in order, so a
    buffer reused by a later copy out cannot be overwritten before an earlier copy back has read it.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int, bool], list[torch.Tensor]] = {}
        self.allocated = 0  # buffers made (the rest of the requests were served from the pool)

    def take(self, numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        free = self._free.get((dtype, numel, pin))
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)

    def give(self, buffer: torch.Tensor, *, pin: bool) -> None:
        self._free.setdefault((buffer.dtype, buffer.numel(), pin), []).append(buffer)


class _StoredStorage:
    """One storage of saved activations as the saver keeps it: compressed and/or in host memory.

    Every saved view of the storage (``q``, ``k`` and ``v`` of one fused projection, a tensor
    and its reshaped copy) shares this one object, so nothing is compressed or copied twice.
    """

    __slots__ = (
        "data",
        "scale",
        "dtype",
        "device",
        "numel",
        "group",
        "offloaded",
        "ready",
        "event",
        "live",
        "__weakref__",
    )

    def __init__(
        self,
        flat: torch.Tensor,
        compression: Compression | None,
        *,
        offload: bool,
        group: tuple[int, int, int] | None,  # saved_tensors.BlockGroup; None: made outside a forward
        buffers: HostBuffers,
        stream: Any = None,
    ) -> None:
        self.dtype, self.device, self.numel, self.group = flat.dtype, flat.device, flat.numel(), group
        self.offloaded = offload  # in host memory (on a CPU-only machine: a second copy in the same memory)
        packed = compress(flat, compression) if compression else None
        data, self.scale = packed if packed is not None else (flat, None)
        if offload:
            pin = stream is not None
            host = buffers.take(data.numel(), data.dtype, pin=pin)
            weakref.finalize(self, buffers.give, host, pin=pin)
            if stream is None:
                host.copy_(data.reshape(-1))
            else:  # after the kernels that made it, beside the ones that follow
                stream.wait_stream(torch.cuda.current_stream(data.device))
                with torch.cuda.stream(stream):
                    host.copy_(data.reshape(-1), non_blocking=True)
                data.record_stream(stream)
            data = host.view(data.shape)
        self.data = data
        self.ready: torch.Tensor | None = None  # the copy back, once prefetched
        self.event: Any = None
        self.live: weakref.ref | None = None  # the restored storage, while backward uses it

    @property
    def copies(self) -> bool:
        return self.offloaded or self.data.dtype != self.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (4 if self.scale is not None else 0)

    def prefetch(self, stream: Any) -> None:
        if not self.offloaded or self.ready is not None or self._alive() is not None:
            return
        if stream is None:  # CPU (or no side stream): the same copy, synchronously
            self.ready = self.data.to(self.device, copy=True)
            return
        with torch.cuda.stream(stream):
            self.ready = self.data.to(self.device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def _alive(self) -> torch.UntypedStorage | None:
        return self.live() if self.live is not None else None

    def restore(self, stream: Any = None) -> torch.Tensor:
        """The whole storage, back on the device in its dtype (shared while backward uses it)."""
        storage = self._alive()
        if storage is not None:
            return torch.empty(0, dtype=self.dtype, device=self.device).set_(storage)
        data = self.data
        if self.offloaded:
            if self.ready is None:
                self.prefetch(stream)  # not prefetched: now, on the side stream all the same
            data = self.ready
            assert data is not None
            if self.event is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(self.event)
                data.record_stream(current)
            # kept until this storage is garbage: a second use later in backward finds it on the device
            self.event = None
        full = decompress(data, self.scale, self.dtype) if data.dtype != self.dtype else data
        self.live = weakref.ref(full.untyped_storage())
        return full


class _SavedView:
    """A saved activation: where it lies in a :class:`_StoredStorage`, and its DTensor layout."""

    __slots__ = ("stored", "geometry", "spec")

    def __init__(self, tensor: torch.Tensor, local: torch.Tensor, stored: _StoredStorage) -> None:
        self.stored = stored
        self.geometry = (local.storage_offset(), tuple(local.shape), local.stride())
        self.spec = (
            (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            if isinstance(tensor, DTensor)
            else None
        )

    def restore(self, stream: Any = None) -> torch.Tensor:
        offset, shape, stride = self.geometry
        local = self.stored.restore(stream).as_strided(shape, stride, offset)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
