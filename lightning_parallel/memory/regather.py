"""Matmul inputs the forward gathered over the tensor ranks, kept as this rank's slice and gathered again
in backward (saved-tensor hooks).

Under sequence parallelism each block's residual stream is split along the sequence over the tensor
ranks, and every column-parallel projection (q|k|v, gate|up, the head) all-gathers its input first.
Autograd then keeps the *gathered* input for the weight's gradient: ``tp`` times the bytes of the
slice the rank owns (Llama 3 70B at TP 4 and 8192 tokens: 2 x 96 KiB a token and layer of the
133 KiB it held). Megatron keeps the slice and gathers it again during backward (Korthikanti et al.
2022, section 4.2.2); so does :class:`GatheredInputSaver`: a saved tensor that the forward made by
redistributing to ``Replicate`` on the tensor-parallel mesh holds the same values on every tensor rank,
so each rank keeps ``1/tp`` of its storage and an all-gather over the tensor ranks rebuilds it, bitwise,
when backward first reads it. The gradients are exactly those without it; the price is one all-gather
of each such input per backward (the planner counts it).

Every tensor rank packs and unpacks the same tensors in the same order (one program, one autograd
graph), so the gathers in backward pair up like the forward's. Views of one storage (q, k and v of one
shared input cast, ``memory/casts.py``) share one slice and one gather. A storage the tensor ranks
cannot split evenly is kept whole.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel.memory.casts import VIEW_NODES, _Geometry
from lightning_parallel.memory.counting import active_counter, local_tensor

__all__ = ["GatheredInputSaver", "RegatherStats", "gathered_over"]

# Autograd nodes a gathered input passes through on its way to a matmul without changing its values'
# layout on the ranks: views, autocast's cast, and the DTensor <-> local tensor wrappers.
_TRANSPARENT = VIEW_NODES | {"ToCopyBackward0", "ToLocalBackward", "FromLocalBackward"}
_GATHER = "RedistributeBackward"
# torch 2.13 names the gather into one tensor all_gather_single (all_gather_into_tensor warns there, and is
# the name torch 2.11 has): the same collective.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gathered_over(tensor: torch.Tensor, mesh: DeviceMesh) -> bool:
    """Whether ``tensor`` is replicated on ``mesh`` by a redistribution the forward ran (a gather or a
    reduction over its ranks), seen through views and casts."""
    if not isinstance(tensor, DTensor) or tensor.device_mesh != mesh:
        return False
    if not all(isinstance(p, Replicate) for p in tensor.placements):
        return False
    fn = tensor.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == _GATHER:
            return True
        if name not in _TRANSPARENT or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


@dataclass
class RegatherStats:
    """What a step kept as slices: saved tensors, distinct storages, their whole and kept bytes, and the
    gathers backward ran."""

    tensors: int = 0
    storages: int = 0
    whole_bytes: int = 0
    kept_bytes: int = 0
    gathers: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _Slice:
    """This rank's slice of one gathered storage; rebuilt whole (one all-gather) when backward needs it."""

    __slots__ = ("piece", "numel", "group", "stats", "pending", "_whole", "_live", "__weakref__")

    def __init__(self, flat: torch.Tensor, mesh: DeviceMesh, stats: RegatherStats) -> None:
        size, rank = mesh.size(), mesh.get_local_rank()
        self.numel = flat.numel()
        share = self.numel // size
        self.piece = flat[rank * share : (rank + 1) * share].clone()
        self.group = mesh.get_group()
        self.stats = stats
        self.pending = 0  # views packed and not yet unpacked: the whole storage is held until they are
        self._whole: torch.Tensor | None = None
        self._live: weakref.ref | None = None

    @property
    def nbytes(self) -> int:
        return self.piece.numel() * self.piece.element_size()

    def whole(self) -> torch.Tensor:
        held = self._whole
        if held is None and self._live is not None:
            storage = self._live()
            if storage is not None:
                held = torch.empty(0, dtype=self.piece.dtype, device=self.piece.device).set_(storage)
        if held is None:
            held = torch.empty(self.numel, dtype=self.piece.dtype, device=self.piece.device)
            _all_gather_single(held, self.piece, group=self.group)
            self.stats.gathers += 1
            self._live = weakref.ref(held.untyped_storage())
        self.pending -= 1
        self._whole = held if self.pending > 0 else None
        return held


class _SavedSlice:
    """A saved tensor kept as a slice of its storage: where it lies in the storage, and its layout."""

    __slots__ = ("slice", "geometry")

    def __init__(self, tensor: torch.Tensor, held: _Slice) -> None:
        self.slice, self.geometry = held, _Geometry(tensor)
        held.pending += 1

    def restore(self) -> torch.Tensor:
        return self.geometry.on(self.slice.whole())


@dataclass
class GatheredInputSaver:
    """The part of the saved-tensor hooks that keeps gathered inputs as slices (``pack``/``unpack``).

    ``mesh``: the tensor-parallel mesh (1-D). ``enabled`` False keeps every tensor whole (the negative
    control of the tests).
    """

    mesh: DeviceMesh
    enabled: bool = True
    stats: RegatherStats = field(default_factory=RegatherStats)
    # storage -> its slice, both weakly: the slice lives as long as a saved tensor in the graph needs it (held
    # strongly, the slices of every micro-batch of a step stayed until the next step began)
    _slices: dict[tuple[str, int], tuple[weakref.ref, weakref.ref[_Slice]]] = field(default_factory=dict)

    def reset(self) -> None:
        """A new step: fresh statistics (the slices of the last step are gone with its graph)."""
        self.stats = RegatherStats()
        self._slices.clear()

    def pack(self, tensor: torch.Tensor) -> _SavedSlice | None:
        """A slice standing for ``tensor`` (reported to the active counter), or None to keep it as it is."""
        if not self.enabled or not isinstance(tensor, DTensor):
            return None
        local = local_tensor(tensor)
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        hit = self._slices.get(key)
        held = hit[1]() if hit is not None and hit[0]() is storage else None
        if held is None:
            # a view of a storage already sliced needs no gather of its own (q, k, v of one shared cast)
            size = self.mesh.size()
            numel = storage.nbytes() // local.element_size()
            if size == 1 or numel % size or not gathered_over(tensor, self.mesh):
                return None
            with torch.no_grad():
                flat = torch.empty(0, dtype=local.dtype, device=local.device).set_(storage)
                held = _Slice(flat, self.mesh, self.stats)
            self._slices[key] = (weakref.ref(storage), weakref.ref(held))
            self.stats.storages += 1
            self.stats.whole_bytes += storage.nbytes()
            self.stats.kept_bytes += held.nbytes
        self.stats.tensors += 1
        counter = active_counter()
        if counter is not None:  # the storage counts as saved, the slice as what stays until backward
            counter.kept_instead(tensor, held.piece)
        return _SavedSlice(tensor, held)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.restore()
