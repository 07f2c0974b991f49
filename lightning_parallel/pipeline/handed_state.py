"""State one block hands a later one outside the hidden state, seen during the sampled step and refused.

Pipeline stages pass on the hidden state alone. Some models hand a later block more than that, in ways
the hidden state's autograd does not show:

- a block returns a second tensor the model loop passes to the next block (DeepSeek-style sparse
  attention's top-k indices, integers: ``hy_v4``'s ``prev_topk_indices``);
- a block writes into a container every block receives (a dict of keys and values shared across layers:
  ``gemma3n``'s and ``kolibri``'s ``shared_kv_states``), which a later block reads.

Cut between the two, the later stage would receive nothing, and fail there (a ``KeyError`` on one rank,
"connection closed" on the others) or compute without it. :class:`HandedState` watches the block calls of
the step :mod:`~lightning_parallel.pipeline.discover` samples and names the argument, so the strategy refuses
the layout at setup, on every rank alike. Caches (objects that are not containers) are not searched: a
training step runs without one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["HandedState"]

_DEPTH = 3  # containers inside containers searched this deep


class HandedState:
    """Per block call: what earlier blocks returned besides the hidden state, and the containers they wrote."""

    def __init__(self) -> None:
        self._returned: dict[int, int] = {}  # id(tensor) -> the block that returned it
        self._kept: list[torch.Tensor] = []  # alive until the step ends, so no other tensor takes their id
        self._written: dict[int, int] = {}  # id(container) -> the first block that wrote into it
        self._before: dict[int, tuple[Any, ...]] = {}  # id(container) -> its content entering the block
        self.found: tuple[int, str, int] | None = None
        """(the later block, its argument, the earlier block) of the first state handed on."""

    def entering(self, index: int, arguments: dict[str, Any], hidden: torch.Tensor) -> None:
        self._before = {}
        for name, value in arguments.items():
            for item in _within(value):
                if item is hidden:
                    continue
                if isinstance(item, torch.Tensor):
                    earlier = self._returned.get(id(item))
                else:
                    earlier = self._written.get(id(item))
                    self._before[id(item)] = _content(item)
                if earlier is not None and earlier < index and self.found is None:
                    self.found = (index, name, earlier)

    def leaving(self, index: int, arguments: dict[str, Any], output: Any, hidden: torch.Tensor) -> None:
        for value in arguments.values():
            for item in _within(value):
                if not isinstance(item, torch.Tensor) and self._before.get(id(item)) != _content(item):
                    self._written.setdefault(id(item), index)
        for item in _within(output):
            if isinstance(item, torch.Tensor) and item is not hidden:
                self._returned.setdefault(id(item), index)
                self._kept.append(item)

    def clear(self) -> None:
        self._returned, self._written, self._before, self._kept = {}, {}, {}, []


def _within(value: Any, depth: int = 0) -> Iterator[Any]:
    """Tensors and containers (dicts, user dicts, lists; tuples are searched, not recorded: they cannot change)."""
    if isinstance(value, torch.Tensor):
        yield value
        return
    if depth > _DEPTH or isinstance(value, (str, bytes)):
        return
    if isinstance(value, Mapping):
        yield value
        for item in list(value.values()):
            yield from _within(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        if isinstance(value, list):
            yield value
        for item in value:
            yield from _within(item, depth + 1)


def _content(container: Any) -> tuple[Any, ...]:
    """What a container holds, by identity (a block that stores a new tensor under a key changes it)."""
    if isinstance(container, Mapping):
        return tuple((key, id(item)) for key, item in container.items())
    return tuple(id(item) for item in container)
