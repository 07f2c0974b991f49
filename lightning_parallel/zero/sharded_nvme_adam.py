"""DeepSpeed's CPU Adam on FSDP2's CPU shards with the optimizer states on NVMe (``offload="nvme"`` on FSDP2).

Between steps a rank holds its shards' Adam states only in files (``zero/nvme_states.py``; the
optimizer's dict keeps their names, as empty scalars); the
step reads them back one parameter ahead of the kernel and writes each back as soon as it is
updated. Checkpoints see an ordinary optimizer: ``state_dict`` reads every state back into
tensors shaped like the parameters' shards (DTensors as they are, so torch's distributed
checkpoint saves and reshards them as it does ``offload="cpu"``'s), and ``load_state_dict``
writes what it loaded to the files and lets go of it. A save therefore holds the states in host
memory while it writes them, as DeepSpeed's NVMe checkpoints do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_parallel.zero.nvme_states import StateFiles
from lightning_parallel.zero.sharded_cpu_adam import ShardedCPUAdam, _local, offloaded, split_by_offload

_KEYS = StateFiles.KEYS


class ShardedNVMeAdam(ShardedCPUAdam):
    """:class:`ShardedCPUAdam` whose states of CPU shards live in files under ``nvme_path`` between steps."""

    def __init__(self, params: Any, *, nvme_path: str | Path, rank: int, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.files = StateFiles(nvme_path, rank)
        order = [p for group in self.param_groups for p in group["params"]]
        self._index = {id(p): i for i, p in enumerate(order)}
        self._on_disk: set[int] = set()

    # ---- the step ---------------------------------------------------------------------------

    def _step_parameters(self) -> None:
        """The kernel over every offloaded parameter in turn, its states read one parameter ahead; then the rest."""
        work: list[tuple[dict[str, Any], torch.Tensor]] = []
        on_device: list[tuple[dict[str, Any], list[torch.Tensor]]] = []
        for group in self.param_groups:
            kernel, kept = split_by_offload(group)
            work += [(group, p) for p in kernel]
            on_device.append((group, kept))
        self._reserve([p for _, p in work])
        self._fetch(work, 0)
        for i, (group, param) in enumerate(work):
            self.files.wait()  # this parameter's states are in, the previous one's are out
            self._fetch(work, i + 1)  # into the other pair of buffers, while this one steps
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            local = _local(param)
            exp_avg, exp_avg_sq = self.files.buffers(i % 2, local.shape, self._state_dtype(param))
            self._kernel_update(group, param, state["step"], exp_avg, exp_avg_sq)
            self.files.write(self._index[id(param)], i % 2, local.numel(), self._state_dtype(param))
            self._on_disk.add(self._index[id(param)])
            _mark_swapped(state)
        self.files.wait()
        for group, params in on_device:
            self._step_on_device(group, params)

    def _reserve(self, params: list[torch.Tensor]) -> None:
        for dtype in {self._state_dtype(p) for p in params}:
            self.files.reserve(max(_local(p).numel() for p in params if self._state_dtype(p) == dtype), dtype)

    def _fetch(self, work: list[tuple[dict[str, Any], torch.Tensor]], position: int) -> None:
        """Start reading the states of ``work[position]`` into its pair of buffers (zeros for a first step)."""
        if position >= len(work):
            return
        param = work[position][1]
        local, dtype, index = _local(param), self._state_dtype(param), self._index[id(param)]
        if index in self._on_disk:
            self.files.read(index, position % 2, local.numel(), dtype)
        else:
            for buffer in self.files.buffers(position % 2, local.shape, dtype):
                buffer.zero_()

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The states read back from their files into tensors like the parameters' shards."""
        loaded = self._read_all()
        try:
            saved = super().state_dict()
            # torch packs the state dicts themselves: copies, so that dropping the states below leaves them here
            saved["state"] = {index: dict(state) for index, state in saved["state"].items()}
            return saved
        finally:
            for param in loaded:
                _mark_swapped(self.state[param])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._write_all()

    def _swappable(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if offloaded(p)]

    def _read_all(self) -> list[torch.Tensor]:
        params = [p for p in self._swappable() if self._index[id(p)] in self._on_disk]
        if params:
            self._reserve(params)
        for param in params:
            local, dtype = _local(param), self._state_dtype(param)
            self.files.read(self._index[id(param)], 0, local.numel(), dtype)
            self.files.wait()
            for key, buffer in zip(_KEYS, self.files.buffers(0, local.shape, dtype), strict=True):
                self.state[param][key] = _like(param, buffer.clone())
        return params

    def _write_all(self) -> None:
        params = [p for p in self._swappable() if _held(self.state.get(p, {}))]
        if params:
            self._reserve(params)
        for param in params:
            local, dtype = _local(param), self._state_dtype(param)
            for key, buffer in zip(_KEYS, self.files.buffers(0, local.shape, dtype), strict=True):
                buffer.copy_(_local(self.state[param].pop(key)))
            self.files.write(self._index[id(param)], 0, local.numel(), dtype)
            self.files.wait()
            self._on_disk.add(self._index[id(param)])
            _mark_swapped(self.state[param])


def _held(state: dict[str, Any]) -> bool:
    """Whether ``state`` holds Adam's states as tensors (just loaded), not the names of swapped ones."""
    return all(isinstance(state.get(key), torch.Tensor) and state[key].dim() > 0 for key in _KEYS)


def _mark_swapped(state: dict[str, Any]) -> None:
    """Adam's state names kept in the optimizer's dict, each as an empty scalar (its value is in a file).

    torch's distributed checkpoint takes the names of the states to load from the optimizer's own dict
    (``_unflatten_optim_state_dict``): without them a resume would load the step only.
    """
    for key in _KEYS:
        state[key] = torch.zeros(())


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a state of ``param``: a DTensor with the parameter's mesh and placements when it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return local
