"""Cut the user's batch into micro-batches, and turn per-micro-batch ``self.log`` calls into one.

The user's ``training_step`` runs once per micro-batch on the last stage, so each of its
``self.log`` calls happens ``M`` times per optimizer step, on the last stage only. Lightning's
logger writes on global rank 0, which holds the *first* stage. So during a pipelined step the
calls are recorded, averaged over the micro-batches (equal sizes: the mean of means is the
batch mean), sent from the last stage to every stage of the pipeline, and replayed once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def split_batch(batch: Any, micro_batches: int) -> list[Any]:
    """``micro_batches`` copies of ``batch`` with every tensor cut along dim 0 (other leaves shared)."""
    if micro_batches == 1:
        return [batch]
    return [_take(batch, micro_batches, index) for index in range(micro_batches)]


def batch_size_of(batch: Any) -> int | None:
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.size(0)
    return None


def check_batch_size(batch: Any, expected: int | None) -> int | None:
    """The batch's size; a ``ValueError`` if it differs from ``expected``, the size the stages were built for.

    torch's pipeline stages fix the shapes they send and receive at their first step, so a smaller last batch
    of an epoch would fail inside a stage (on one rank, while the others wait). Raised on every rank alike.
    """
    size = next(
        (leaf.size(0) for leaf in _leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0), None
    )
    if expected is not None and size is not None and size != expected:
        raise ValueError(
            f"Pipeline parallelism: a training batch of {size} samples after batches of {expected}; the pipeline"
            " stages are built for one batch size. Give the DataLoader `drop_last=True` (or a dataset length that"
            " the batch size divides) so that every batch has the same size."
        )
    return size if expected is None else expected


def check_divisible(batch: Any, micro_batches: int) -> None:
    for leaf in _leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.size(0) % micro_batches:
            raise ValueError(
                f"`micro_batches={micro_batches}` does not divide the batch size {leaf.size(0)} (a tensor of shape"
                f" {tuple(leaf.shape)} in the batch). Use a DataLoader batch size that is a multiple of"
                f" {micro_batches}, or change `micro_batches` to a divisor of {leaf.size(0)}."
            )


def _leaves(batch: Any) -> Iterator[Any]:
    if isinstance(batch, Mapping):
        for value in batch.values():
            yield from _leaves(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _leaves(value)
    else:
        yield batch


def _take(batch: Any, parts: int, index: int) -> Any:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        return batch.tensor_split(parts, dim=0)[index]
    if isinstance(batch, Mapping):
        items = {key: _take(value, parts, index) for key, value in batch.items()}
        try:
            return type(batch)(items)
        except TypeError:  # mappings whose constructor takes something else
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(value, parts, index) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(value, parts, index) for value in batch)
    return batch


class LogRecorder:
    """Collects ``self.log`` calls of the micro-batches of one step; replays their mean once."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, tuple[Any, dict[str, Any]]]] = defaultdict(dict)

    @contextmanager
    def recording(self, module: nn.Module, micro_batch: Callable[[], int]) -> Iterator[None]:
        """Patch ``module.log`` (``log_dict`` calls ``log``) to record under the current micro-batch."""

        def log(name: str, value: Any, **kwargs: Any) -> None:
            # A later call for the same micro-batch (torch's shape inference runs micro-batch 0
            # once more) replaces the earlier one. Detached: a logged loss would keep its micro-batch's
            # graph, and with it the stage's received input, until the step ends (issue 34).
            if isinstance(value, torch.Tensor):
                value = value.detach()
            self.calls[micro_batch()][name] = (value, kwargs)

        module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            del module.log

    def averaged(
        self, module: nn.Module, device: torch.device | None = None
    ) -> list[tuple[str, Any, dict[str, Any]]]:
        """``[(name, value, kwargs)]``: tensors and numbers averaged (on ``device``, default the host), metrics
        named by their module path."""
        names: dict[str, None] = {}
        for calls in self.calls.values():
            names.update(dict.fromkeys(calls))
        out: list[tuple[str, Any, dict[str, Any]]] = []
        for name in names:
            entries = [calls[name] for calls in self.calls.values() if name in calls]
            value, kwargs = entries[-1]
            if isinstance(value, nn.Module):  # a torchmetrics Metric: send where it lives, not its state
                path = next((n for n, m in module.named_modules() if m is value), None)
                out.append((name, ("module", path), kwargs))
                continue
            values = [
                torch.as_tensor(v.detach() if isinstance(v, torch.Tensor) else v).float().to(device or "cpu")
                for v, _ in entries
            ]
            out.append((name, ("value", torch.stack(values).mean()), kwargs))
        return out

    def clear(self) -> None:
        self.calls.clear()


def replay_logs(
    module: nn.Module, records: Sequence[tuple[str, Any, dict[str, Any]]], device: torch.device
) -> None:
    """Call the real ``module.log`` once per recorded name, with the same keyword arguments."""
    for name, (kind, payload), kwargs in records:
        if kind == "module":
            if payload is None:
                continue
            module.log(name, module.get_submodule(payload), **kwargs)
        else:
            module.log(name, payload.to(device), **kwargs)


class StepLogs:
    """The mean loss and the logs of a step, from the last stage to every stage, without a host round trip
    of the values: they travel as one tensor on the device, one broadcast per step, its first three numbers a
    header (the version of what the values are, their count, whether an ``extra`` object follows). What they
    are (names, kinds, ``self.log`` arguments) goes as an object only on a step where it changed; reading the
    header is the receiving ranks' one host sync of the step. ``extra``: what an evaluation step returned,
    when it returned something.
    """

    # Values that travel with the header; a step logging more sends the rest in a second broadcast.
    CAPACITY = 32

    def __init__(self) -> None:
        self.structure: list[tuple[str, str, Any, dict[str, Any]]] | None = None
        self.version = 0

    def share(
        self,
        payload: tuple[torch.Tensor, list[tuple[str, Any, dict[str, Any]]]] | None,
        src: int,
        group: dist.ProcessGroup,
        device: torch.device,
        extra: Any = None,
    ) -> tuple[torch.Tensor, list[tuple[str, Any, dict[str, Any]]], Any]:
        """``payload`` (mean loss, records) and ``extra`` on the rank ``src`` of ``group``; on every rank its copy."""
        sending = dist.get_rank(group) == src
        size = 3 + self.CAPACITY
        if sending:
            assert payload is not None
            mean, records = payload
            structure = [(n, kind, None if kind == "value" else v, kw) for n, (kind, v), kw in records]
            values = torch.cat(
                [mean.reshape(1)] + [v.reshape(1) for _, (k, v), _ in records if k == "value"]
            ).double()  # float32 values and small integers, all exact in float64
            changed = not _same(structure, self.structure)
            self.version += changed
            count, has_extra = values.numel(), extra is not None
            header = torch.tensor([self.version, count, has_extra], dtype=torch.float64, device=device)
            message = torch.cat([header, values[: self.CAPACITY]])
            message = torch.cat([message, message.new_zeros(size - message.numel())])
        else:
            message = torch.empty(size, dtype=torch.float64, device=device)
        dist.broadcast(message, group=group, group_src=src)
        if sending:
            if changed:
                broadcast_from(structure, src, group)
                self.structure = structure
        else:
            version, count, has_extra = (int(v) for v in message[:3].tolist())
            if version != self.version:
                self.structure, self.version = broadcast_from(None, src, group), version
        if has_extra:
            extra = broadcast_from(extra if sending else None, src, group)
        flat = message[3 : 3 + min(count, self.CAPACITY)]
        if count > self.CAPACITY:
            rest = values[self.CAPACITY :] if sending else message.new_empty(count - self.CAPACITY)
            dist.broadcast(rest, group=group, group_src=src)
            flat = torch.cat([flat, rest])
        flat = flat.float()
        return flat[0], self._records(flat[1:]), extra

    def _records(self, flat: torch.Tensor) -> list[tuple[str, Any, dict[str, Any]]]:
        assert self.structure is not None
        out, position = [], 0
        for name, kind, path, kwargs in self.structure:
            if kind == "value":
                out.append((name, ("value", flat[position]), kwargs))
                position += 1
            else:
                out.append((name, (kind, path), kwargs))
        return out


def _same(structure: Any, cached: Any) -> bool:
    try:
        return bool(cached is not None and structure == cached)
    except (RuntimeError, ValueError, TypeError):  # kwargs that do not compare (a tensor): sent again
        return False


def broadcast_from(obj: Any, src_group_rank: int, group: dist.ProcessGroup | None) -> Any:
    """Send a picklable object from one rank of ``group`` to all of them."""
    if group is None or dist.get_world_size(group) == 1:
        return obj
    box = [obj if dist.get_rank(group) == src_group_rank else None]
    dist.broadcast_object_list(box, group_src=src_group_rank, group=group)
    return box[0]
