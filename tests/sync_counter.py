"""Count what would stop a GPU's queue for the host: syncs made by the project's code, on CPU.

On a GPU a step crawls when the host waits for the device: a scalar read (``.item()``, ``int()``,
``bool()``), an output whose size depends on the data (``nonzero``, boolean indexing, ``bincount``,
``repeat_interleave`` without ``output_size``, ``masked_select``, ``unique``), or a copy to the host
(``.cpu()``, ``.tolist()``, ``.numpy()``, ``.to("cpu")``, ``.to(torch.device("cpu"))``). On CPU none of them costs anything, so they
are counted instead: a dispatch mode sees the kernels, a function mode the host copies (which never
reach a kernel on the CPU), and each is charged to the project's code when the nearest caller outside
torch is in ``lightning_parallel`` (a user's model or Lightning may sync on its own; not ours to
budget). Tensors the project makes on the host on purpose (``tests/device_guard.HostMarking``: a
micro-batch index, a row index) stay there on a GPU too: reading them costs no sync and is not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.device_guard import HostMarking, is_host_tensor, project_frame, project_line, spelled_host

aten = torch.ops.aten
SIZE_FROM_DATA = {
    aten.nonzero.default, aten.masked_select.default, aten.bincount.default, aten._unique2.default,
    aten.unique_consecutive.default, aten.unique_dim.default,
}  # fmt: skip
HOST_COPIES = {torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy}
# Seen here rather than as ``_local_scalar_dense`` in the kernels: the tensor read is the one called on.
SCALAR_READS = {torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__bool__,
                torch.Tensor.__index__}  # fmt: skip


def _sync_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
    if func in SIZE_FROM_DATA:
        return "size from data"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "size from data"
    if func is aten.index.Tensor and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
    ):
        return "size from data"
    return None


class SyncCounter:
    """Host syncs charged to the project's code, by ``file:line`` and kind."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.enabled = True

    def record(self, kind: str) -> None:
        if self.enabled:
            where = project_line(through_torch=True)
            if where is not None:
                self.counts[(kind, where)] += 1

    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> Counter[tuple[str, str]]:
        counts, self.counts = self.counts, Counter()
        return counts

    @contextmanager
    def counting(self) -> Iterator[SyncCounter]:
        with HostMarking(), _Functions(self), _Kernels(self):
            yield self


class _Kernels(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _sync_kind(func, args, kwargs)
        if kind is not None and not (args and is_host_tensor(args[0])):
            self.counter.record(kind)
        return func(*args, **kwargs)


class _Functions(TorchFunctionMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        host = bool(args) and is_host_tensor(args[0])
        if not host and (func in HOST_COPIES or (func is torch.Tensor.to and _to_host(args, kwargs))):
            self.counter.record("host copy")
        if not host and func in SCALAR_READS:
            self.counter.record("scalar read")
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    """``.to("cpu")`` or ``.to(torch.device("cpu"))`` spelled out in the project's code (a ``torch.device`` it
    read from a parameter is the GPU on a GPU: :func:`tests.device_guard.spelled_host`)."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, str):
        return target.startswith("cpu")
    return isinstance(target, torch.device) and spelled_host(target, project_frame())
