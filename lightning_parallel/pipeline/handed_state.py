"""State one block hands a later one outside the hidden state, seen during the sampled step: kept on one stage.

Pipeline stages pass on the hidden state alone. Some models hand a later block more than that, in ways
the hidden state's autograd does not show:

- a block returns a second tensor the model loop passes to the next block (DeepSeek-style sparse
  attention's top-k indices, integers: ``hy_v4``'s ``prev_topk_indices``);
- a block writes into a container every block receives (a dict of keys and values shared across layers:
  ``gemma3n``'s and ``kolibri``'s ``shared_kv_states``), which a later block reads.

Cut between the two, the later stage would receive nothing, and fail there (a ``KeyError`` on one rank,
"connection closed" on the others) or compute without it. :class:`HandedState` watches the block calls of
the step :mod:`~lightning_parallel.pipeline.discover` samples: what a block returned besides the hidden state
and what it stored in a container are candidates, and a later block that computes with one of them (a
``TorchFunctionMode`` entered around each block sees the tensors its operations receive) makes a pair. The
stage split then puts no boundary between the blocks of a pair (``pipeline/setup.py``): each stage runs the
model from its first line, so the container is made again there and filled by the stage's own writer; a
layout with no such cut is refused at setup, on every rank alike, naming the blocks and the argument. A candidate a later block receives but never
computes with (GLM-DSA's top-k indices on layers that select their own) is no state handed on. Caches
(objects that are not containers) are not searched: a training step runs without one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HandedState"]

_DEPTH = 3  # containers inside containers searched this deep


class _Reads(TorchFunctionMode):
    """Around one block's forward: the candidates its operations compute with."""

    def __init__(self, state: HandedState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.state.saw((args, kwargs))
        return func(*args, **kwargs)


class HandedState:
    """Per block call: the tensors earlier blocks handed on besides the hidden state, and who computes with them."""

    def __init__(self) -> None:
        self._candidates: dict[
            int, tuple[int, str]
        ] = {}  # id(tensor) -> (the block that made it, how it travels)
        self._kept: list[torch.Tensor] = []  # alive until the step ends, so no other tensor takes their id
        self._before: dict[
            int, tuple[str, tuple[Any, ...]]
        ] = {}  # id(container) -> (argument, content entering)
        self._watched: dict[int, str] = {}  # id(candidate) -> the argument it came in, for the block running
        self._index = -1
        self._reads: _Reads | None = None
        self.pairs: dict[tuple[int, int], str] = {}
        """(the earlier block, the later one) -> the later block's argument the state came in, for each state
        handed on: a pipeline stage boundary must not fall between them."""

    def entering(self, index: int, arguments: dict[str, Any], hidden: torch.Tensor) -> None:
        self._index, self._before, self._watched = index, {}, {}
        for name, value in arguments.items():
            for item in _within(value):
                if isinstance(item, torch.Tensor):
                    if item is not hidden and id(item) in self._candidates:
                        self._watched[id(item)] = name
                else:
                    self._before[id(item)] = (name, _content(item))
        self._reads = _Reads(self)
        self._reads.__enter__()

    def saw(self, values: Any) -> None:
        """An operation of the running block received ``values``: does it compute with a candidate?"""
        if not self._watched:
            return
        for item in _within(values):
            if isinstance(item, torch.Tensor) and id(item) in self._watched:
                earlier = self._candidates[id(item)][0]
                if earlier < self._index:
                    self.pairs.setdefault((earlier, self._index), self._watched[id(item)])

    def leaving(self, index: int, arguments: dict[str, Any], output: Any, hidden: torch.Tensor) -> None:
        self._stop_watching()
        for value in arguments.values():
            for item in _within(value):
                if isinstance(item, torch.Tensor) or id(item) not in self._before:
                    continue
                name, before = self._before[id(item)]
                if before != _content(item):  # the block stored something: what it stored is handed on
                    known = {entry for entry in before}
                    for stored in _stored(item, known):
                        self._candidate(stored, index, name)
        for item in _within(output):
            if isinstance(item, torch.Tensor) and item is not hidden:
                self._candidate(item, index, "returned")

    def is_candidate(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one a block stored or returned (followed exactly by its identity)."""
        return id(tensor) in self._candidates

    def clear(self) -> None:
        self._stop_watching()
        self._candidates, self._before, self._watched, self._kept = {}, {}, {}, []

    def _candidate(self, tensor: torch.Tensor, index: int, how: str) -> None:
        for item in _within(tensor):
            self._candidates.setdefault(id(item), (index, how))
            self._kept.append(item)

    def _stop_watching(self) -> None:
        if self._reads is not None:
            self._reads.__exit__(None, None, None)
            self._reads = None


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


def _stored(container: Any, known: set[Any]) -> Iterator[Any]:
    """The entries of ``container`` not among ``known`` (its content before the block ran)."""
    if isinstance(container, Mapping):
        for key, item in container.items():
            if (key, id(item)) not in known:
                yield item
    else:
        for item in container:
            if id(item) not in known:
                yield item
