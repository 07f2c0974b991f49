"""What a forward-only pipeline step moves: each stage's activation to the next, the last stage's outputs.

Training's transfers are torch's (its stages know every shape from their first step). Evaluation runs a
plain chain of point-to-point sends in stage order instead (no autograd, no schedule), and its batches may
differ in size from training's, so the first micro-batch's activation is preceded by a small header (its
rank, dtype and shape: one host read on the receiver); the step's other micro-batches have that shape. The
last stage merges its micro-batches' outputs into what the step returned for the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_parallel.compat import tree_map_only

__all__ = ["StageChain", "merge_outputs", "receive_activation", "send_activation", "to_cpu", "to_device"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]


def send_activation(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, *, header: bool = True
) -> list[Any]:
    """``tensor`` to ``dst``; ``header``: preceded by its shape and dtype (the receiver knows them otherwise)."""
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    tensor = tensor.detach().contiguous()
    works = []
    if header:
        described = torch.zeros(10, dtype=torch.int64, device=tensor.device)
        described[0], described[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        described[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        works.append(dist.isend(described, group=group, group_dst=dst))
    return [*works, dist.isend(tensor, group=group, group_dst=dst)]


def receive_activation(
    src: int,
    group: dist.ProcessGroup,
    device: torch.device,
    known: tuple[list[int], torch.dtype] | None = None,
) -> torch.Tensor:
    """A tensor from ``src``: its shape and dtype ``known``, or read from the header sent before it."""
    if known is None:
        header = torch.zeros(10, dtype=torch.int64, device=device)
        dist.recv(header, group=group, group_src=src)
        values = header.tolist()  # one host read
        known = (values[2 : 2 + values[0]], _DTYPES[values[1]])
    shape, dtype = known
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, group=group, group_src=src)
    return buffer


class StageChain:
    """One evaluation step's activations between this rank's stages and the other ranks' (stage ``s`` runs on
    rank ``owners[s]``): received before a stage whose predecessor lives elsewhere, sent after a stage whose
    successor does. Only the first micro-batch's transfer carries a header; the others reuse its shape."""

    def __init__(self, owners: list[int], rank: int, group: dist.ProcessGroup, device: torch.device) -> None:
        self.owners, self.rank, self.group, self.device = owners, rank, group, device
        self.stages = [stage for stage, owner in enumerate(owners) if owner == rank]
        # by receiving stage, from its first header
        self._shapes: dict[int, tuple[list[int], torch.dtype]] = {}
        self._sends: list[Any] = []
        self._sent_header: set[int] = set()

    def input_of(self, stage: int, carried: torch.Tensor | None) -> torch.Tensor | None:
        """What ``stage`` starts from: the previous stage's output, received if another rank ran it."""
        if stage == 0 or self.owners[stage - 1] == self.rank:
            return carried
        received = receive_activation(
            self.owners[stage - 1], self.group, self.device, self._shapes.get(stage)
        )
        self._shapes[stage] = (list(received.shape), received.dtype)
        return received

    def pass_on(self, stage: int, output: Any) -> Any:
        """Send ``output`` on if the next stage runs elsewhere; returns what this rank's next stage gets."""
        if stage == len(self.owners) - 1:
            return None
        if self.owners[stage + 1] != self.rank:
            self._sends += send_activation(
                output, self.owners[stage + 1], self.group, header=stage not in self._sent_header
            )
            self._sent_header.add(stage)
        return output

    def wait(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends = []


def merge_outputs(outputs: list[Any]) -> Any:
    """One step output from the micro-batches': scalar losses averaged, batched tensors concatenated."""
    first = outputs[0]
    if len(outputs) == 1 or first is None:
        return first
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack([o.float() for o in outputs]).mean()
        return torch.cat(outputs, dim=0)
    if isinstance(first, dict):
        return {k: merge_outputs([o[k] for o in outputs]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(merge_outputs(list(items)) for items in zip(*outputs, strict=False))
    return first


def to_cpu(value: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().cpu(), value)


def to_device(value: Any, device: torch.device) -> Any:
    return tree_map_only(torch.Tensor, lambda tensor: tensor.to(device), value)
