"""Adam's two state tensors of each CPU shard in files on a fast disk, through DeepSpeed's async I/O.

``offload="nvme"`` on the FSDP2 engine (ZeRO-2, and ZeRO-3 with tensor, pipeline or expert parallelism):
FSDP2 offloads to host memory only, so the sharded parameters and their gradients live there
(``CPUOffloadPolicy``) and the optimizer states, half of Adam's model-state bytes in fp32, go to
``offload_path``. They come back two at a time for the step: while DeepSpeed's CPU Adam updates one
parameter's states in one pair of pinned buffers, the next parameter's are read into the other pair
and the previous ones written back (``StateFiles.read`` / ``write`` are asynchronous; ``wait``
completes both), as DeepSpeed's own pipelined optimizer swapper overlaps its reads and writes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

ALIGNMENT_BYTES = 1024  # every file a whole number of 1 KiB blocks (O_DIRECT; DeepSpeed's AIO_ALIGNED_BYTES)
SLOTS = 2  # one pair of buffers being stepped, one being read or written


def padded(numel: int, element_size: int = 4) -> int:
    """Elements a file holds for ``numel`` (rounded up to whole aligned blocks, as DeepSpeed pads its swaps)."""
    per_block = ALIGNMENT_BYTES // element_size
    return -(-numel // per_block) * per_block


class StateFiles:
    """The files of one rank's optimizer states, ``<folder>/rank<r>/<parameter index>.<state>``, and the pinned
    buffers they are read into and written from."""

    KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(self, folder: str | Path, rank: int) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self.folder = Path(folder) / "optimizer_states" / f"rank{rank}"
        shutil.rmtree(self.folder, ignore_errors=True)  # a previous run's files never meet this run's states
        self.folder.mkdir(parents=True, exist_ok=True)
        aio = AsyncIOBuilder().load(verbose=False)
        self.handle = aio.aio_handle(1 << 20, 8, False, True, 1)  # DeepSpeed's default aio config
        self._buffers: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}
        self.bytes_written = 0
        self.bytes_read = 0
        self.pending = 0

    def path(self, index: int, key: str) -> str:
        return str(self.folder / f"{index}.{key}")

    def reserve(self, numel: int, dtype: torch.dtype) -> None:
        """Pinned buffers for states of up to ``numel`` elements (called with nothing in flight)."""
        assert self.pending == 0, "buffers are replaced only between steps"
        for slot in range(SLOTS):
            for key in self.KEYS:
                current = self._buffers.get((slot, key, dtype))
                size = padded(numel, dtype.itemsize)
                if current is None or current.numel() < size:
                    if current is not None:
                        self.handle.free_cpu_locked_tensor(current)
                    example = torch.empty(0, dtype=dtype)
                    self._buffers[(slot, key, dtype)] = self.handle.new_cpu_locked_tensor(size, example)

    def buffers(self, slot: int, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The ``slot``'s (exp_avg, exp_avg_sq) as tensors of ``shape`` (views of the pinned buffers)."""
        numel = shape.numel()
        return tuple(self._buffers[(slot, key, dtype)][:numel].view(shape) for key in self.KEYS)

    def read(self, index: int, slot: int, numel: int, dtype: torch.dtype) -> None:
        self.bytes_read += self._submit(self.handle.async_pread, index, slot, numel, dtype)

    def write(self, index: int, slot: int, numel: int, dtype: torch.dtype) -> None:
        self.bytes_written += self._submit(self.handle.async_pwrite, index, slot, numel, dtype)

    def _submit(self, operation: Any, index: int, slot: int, numel: int, dtype: torch.dtype) -> int:
        """Start ``operation`` (the handle's async read or write) on both states; the bytes it moves."""
        moved = 0
        for key in self.KEYS:
            buffer = self._buffers[(slot, key, dtype)][: padded(numel, dtype.itemsize)]
            if operation(buffer, self.path(index, key), 0) != 0:
                raise OSError(f"offload='nvme': DeepSpeed's async I/O refused {self.path(index, key)}")
            moved += buffer.numel() * buffer.element_size()
            self.pending += 1
        return moved

    def wait(self) -> None:
        """Complete every read and write in flight (DeepSpeed's handle waits for all of them at once)."""
        if self.pending:
            completed = self.handle.wait()
            if completed != self.pending:
                raise OSError(
                    f"offload='nvme': {self.pending} reads/writes of optimizer states under {self.folder} were issued"
                    f" and {completed} completed. Check that the disk has room and the folder is writable."
                )
            self.pending = 0

    def disk_bytes(self) -> int:
        """Bytes the state files hold on disk now (what the memory tests compare with the theory)."""
        return sum(f.stat().st_size for f in self.folder.iterdir())
