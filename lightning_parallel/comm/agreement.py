"""Tensors for collectives on the device the group's backend takes, and the one "did every rank succeed?" vote.

NCCL takes only CUDA tensors; a flag made with ``torch.tensor(...)`` lives on the CPU and would end
a GPU job at its first collective (gloo takes both, so no CPU test would see it). Every small
tensor the project creates only to communicate (flags, counts) is made on
:func:`communication_device` of its group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def communication_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: the current CUDA device under NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_agree(ok: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when ``ok`` is true on every rank of ``group``: all take the same decision,
    so none goes on alone into a collective the others never reach."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=communication_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
