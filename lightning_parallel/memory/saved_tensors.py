"""Activations saved for backward, offloaded to host memory and/or stored in a smaller format.

One pair of ``torch.autograd.graph.saved_tensors_hooks`` does both (hooks do not nest: the
innermost pair receives every saved tensor, so offload and compression must be one pair):

- **compression** (the idea of Gist, Jain et al. 2018): a floating-point activation is stored
  as ``bf16`` (round to nearest: relative error at most 2^-9 per element) or ``fp8`` (e4m3 with
  one fp32 scale per tensor: relative error at most 2^-4) and cast back when the backward pass
  needs it. The forward pass is untouched, so the loss of a step is exact; only gradients see
  the rounding (see docs/memory.md for its measured effect).
- **offload**: the (possibly compressed) activation is copied to host memory (pinned, so the
  copies are asynchronous on a GPU) and comes back when the backward pass needs it. Copies back
  are prefetched one block ahead: the first activation the backward pass unpacks from block
  ``i`` starts the copies of block ``i - 1``'s activations on a side stream. On a CPU-only
  machine host and device are the same memory: the copies still run (so the code path is the
  one a GPU runs), they just save nothing.

Parameters (weights saved by matmuls) are never touched. DTensor activations (tensor
parallelism) are handled through their local shard and rebuilt with the same placements.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_parallel.memory.counting import (
    SavedTensorCounter,
    activate,
    active_counter,
    local_tensor,
    storage_key,
)

__all__ = ["COMPRESSIONS", "ActivationSaver", "compress", "decompress"]

Compression = Literal["bf16", "fp8"]
COMPRESSIONS: tuple[str, ...] = ("bf16", "fp8")
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)


def compress(tensor: torch.Tensor, kind: Compression) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(stored, scale)`` for a floating-point tensor worth compressing, else ``None``."""
    if not tensor.is_floating_point() or tensor.dim() == 0:
        return None
    if kind == "bf16":
        if tensor.element_size() <= 2:
            return None
        return tensor.to(torch.bfloat16), None
    if tensor.element_size() <= 1:
        return None
    amax = tensor.detach().abs().amax().float()
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    return (tensor.float() / scale).to(_FP8), scale


def decompress(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return stored.to(dtype)
    return (stored.float() * scale.to(stored.device)).to(dtype)


class _HostCopy:
    """One storage copied to host memory, shared by every saved view of it."""

    __slots__ = ("host", "device", "group", "ready", "event", "live", "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, group: int) -> None:
        self.device, self.group = device, group
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        pin = device.type == "cuda"
        self.host = torch.empty(source.shape, dtype=torch.uint8, device="cpu", pin_memory=pin)
        self.host.copy_(source, non_blocking=pin)
        self.ready: torch.Tensor | None = None  # the copy back, once prefetched
        self.event: Any = None
        self.live: weakref.ref | None = None  # the copy back, while restored views use it

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def prefetch(self, stream: Any) -> None:
        if self.ready is not None or (self.live is not None and self.live() is not None):
            return
        if stream is None:  # CPU (or no side stream): the same copy, synchronously
            self.ready = self.host.to(self.device, copy=True)
            return
        with torch.cuda.stream(stream):
            self.ready = self.host.to(self.device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def fetch(self) -> torch.UntypedStorage:
        """The storage back on the device: prefetched, still in use by another view, or copied now."""
        storage = self.live() if self.live is not None else None
        if storage is not None:
            return storage
        if self.ready is None:
            self.prefetch(None)
        ready = self.ready
        assert ready is not None
        if self.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.event)
            ready.record_stream(current)
        storage = ready.untyped_storage()
        self.ready, self.event, self.live = None, None, weakref.ref(storage)
        return storage


class _Packed:
    """One saved activation as the saver keeps it until the backward pass."""

    __slots__ = ("data", "scale", "dtype", "spec", "host", "geometry")

    def __init__(self, tensor: torch.Tensor, compression: Compression | None) -> None:
        local = local_tensor(tensor).detach()
        self.spec = (
            (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            if isinstance(tensor, DTensor)
            else None
        )
        self.dtype = local.dtype
        packed = compress(local, compression) if compression else None
        self.data, self.scale = packed if packed is not None else (local, None)
        self.host: _HostCopy | None = None
        self.geometry: tuple[torch.dtype, int, tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def compressed(self) -> bool:
        return self.data.dtype != self.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + (4 if self.scale is not None else 0)

    def move_to_host(self, host: _HostCopy) -> None:
        """Keep only ``host`` (a copy of the storage of ``data``) and where ``data`` lies in it."""
        data = self.data
        self.geometry = (data.dtype, data.storage_offset(), tuple(data.shape), data.stride())
        self.host, self.data = host, torch.empty(0, dtype=data.dtype)

    def restore(self) -> torch.Tensor:
        data = self.data
        if self.host is not None and self.geometry is not None:
            dtype, offset, shape, stride = self.geometry
            data = torch.empty(0, dtype=dtype, device=self.host.device)
            data.set_(self.host.fetch(), offset, shape, stride)
        local = decompress(data, self.scale, self.dtype) if data.dtype != self.dtype else data
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class ActivationSaver:
    """Saved-tensor hooks that compress and/or offload activations; use :meth:`context` around forward.

    Args:
        compression: ``"bf16"``, ``"fp8"`` or ``None``.
        offload: keep saved activations in host memory until the backward pass.
        parameters: the model's parameters: saved weights are left alone.
        blocks: the repeated blocks, in forward order: offloaded activations are grouped by the
            block that produced them, so the backward pass can prefetch the previous block's.
    """

    def __init__(
        self,
        compression: Compression | None = None,
        offload: bool = False,
        parameters: Sequence[torch.Tensor] = (),
        blocks: Sequence[nn.Module] = (),
    ) -> None:
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS} or None, got {compression!r}")
        self.compression = compression
        self.offload = offload
        self._param_keys = {storage_key(p) for p in parameters}
        # Two ops saving the same tensor share one packed copy (weakly keyed by its live storage).
        self._cache: dict[tuple, tuple[weakref.ref, _Packed]] = {}
        self._hosted: dict[tuple, tuple[weakref.ref, _HostCopy]] = {}
        self._groups: dict[int, list[weakref.ref[_HostCopy]]] = {}
        self._prefetched: set[int] = set()
        self._block_entries = 0
        self._stream: Any = None
        self.handles: list[RemovableHandle] = [b.register_forward_pre_hook(self._enter_block) for b in blocks]

    @property
    def enabled(self) -> bool:
        return self.offload or self.compression is not None

    def _enter_block(self, module: nn.Module, args: Any) -> None:
        self._block_entries += 1

    @contextmanager
    def context(self, counter: SavedTensorCounter | None = None) -> Iterator[None]:
        """Forward passes inside save their activations through this saver (and ``counter``)."""
        self._groups.clear()  # the previous step's backward has finished
        self._prefetched.clear()
        self._block_entries = 0
        try:
            with activate(counter), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._cache.clear()
            self._hosted.clear()

    # ---- hooks ---------------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> Any:
        if storage_key(tensor) in self._param_keys:
            return tensor
        counter = active_counter()
        new_storage = counter.saw(tensor) if counter is not None else True
        local = local_tensor(tensor)
        key = (storage_key(tensor), local.storage_offset(), tuple(local.shape), local.stride(), local.dtype,
               local._version)  # fmt: skip
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is not None:
            return hit[1]
        with torch.no_grad():
            packed = _Packed(tensor, self.compression)
            self._cache[key] = (weakref.ref(local.untyped_storage()), packed)
            if packed.compressed and counter is not None:
                counter.stored(packed.nbytes, offloaded=self.offload)
            if self.offload:
                self._offload(packed, counter, new_storage)
            elif not packed.compressed:
                if counter is not None and new_storage:
                    counter.stored(local.untyped_storage().nbytes(), offloaded=False)
                return tensor  # nothing to do for this one (an fp16 tensor under bf16 compression)
        return packed

    def _offload(self, packed: _Packed, counter: SavedTensorCounter | None, new_storage: bool) -> None:
        """Copy the storage behind ``packed.data`` to host memory, once per storage."""
        storage = packed.data.untyped_storage()
        key = (str(packed.data.device), storage.data_ptr())
        hit = self._hosted.get(key)
        host = hit[1] if hit is not None and hit[0]() is not None else None
        if host is None:
            host = _HostCopy(storage, packed.data.device, self._block_entries)
            self._hosted[key] = (weakref.ref(storage), host)
            self._groups.setdefault(host.group, []).append(weakref.ref(host))
            if counter is not None and not packed.compressed:
                counter.stored(host.nbytes, offloaded=True)
        packed.move_to_host(host)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.host is not None:
            self._prefetch(packed.host.group - 1, packed.host.device)
        return packed.restore()

    def _prefetch(self, group: int, device: torch.device) -> None:
        """Start bringing back the activations of the block before ``group`` (once per step)."""
        if group < 0 or group in self._prefetched:
            return
        self._prefetched.add(group)
        if device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream if device.type == "cuda" else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        for ref in self._groups.get(group, []):
            host = ref()
            if host is not None:
                host.prefetch(stream)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
