"""Mid-epoch resume for plain ``DataLoader``\\ s: continue with the very next batch.

Lightning 2.6 stores a training loader's position only if the loader is *stateful* (has
``state_dict``/``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``): the fit loop puts
``[loader.state_dict(), ...]`` under ``loops.fit_loop.state_dict.combined_loader`` and gives it
back to ``load_state_dict`` before the first batch. A plain ``DataLoader`` is restarted from its
first batch while the batch counter continues, so a checkpoint taken after batch ``k`` replays
batches ``0..n-k-1`` and never sees ``k..n-1``.

:func:`make_resumable` returns a shallow copy of the user's loader (same class, same dataset,
workers and collate function) that is stateful. Its state is small: the epoch it was iterating,
and the random state at the moment that epoch's iteration started (per rank), because a
``RandomSampler`` without a generator draws its permutation seed from the global torch RNG,
and a generator passed by the user moves on every epoch. On resume it rebuilds the epoch's
iteration from that state and drops the index lists of the batches already trained on before
any data is loaded (only indices are generated), so ``RandomSampler``, ``DistributedSampler``
and any sampler that is a function of those random states continue exactly.

How many batches to drop is asked from Lightning at the first ``next()`` (its batch progress
after its own restart adjustments: a batch that was in flight when the checkpoint was taken is
redone by Lightning, so it is not dropped here either); without a trainer, the count of batches
this loader had handed out is used.

An ``IterableDataset`` has no indices to drop: its epoch is iterated again from the same random
state (workers included: their seeds come from it) and the batches already trained are read and
dropped. Exact for a stream that is a function of that state (files in order, a shuffle drawn at
its start, seeded workers); the price is reading those batches again once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

__all__ = ["ResumableDataLoaderMixin", "make_resumable"]

# (epoch, batches already trained in it) as Lightning counts them.
Progress = Callable[[], tuple[int, int]]


def _generators(loader: DataLoader) -> dict[str, torch.Generator]:
    """Generators that decide the order of batches: the loader's, its sampler's, its batch sampler's sampler's."""
    found: dict[str, torch.Generator] = {}
    candidates = {
        "loader": loader,
        "sampler": loader.sampler,
        "batch_sampler": loader.batch_sampler,
        "batch_sampler.sampler": getattr(loader.batch_sampler, "sampler", None),
    }
    seen: set[int] = set()
    for name, owner in candidates.items():
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            found[name] = generator
    return found


def _random_state(loader: DataLoader) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "generators": {name: g.get_state() for name, g in _generators(loader).items()},
    }


def _set_random_state(loader: DataLoader, state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    generators = _generators(loader)
    for name, value in state["generators"].items():
        if name in generators:
            generators[name].set_state(value)


def gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank (this rank's alone without a process group)."""

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _length(loader: Any) -> int | None:
    """Batches per epoch, None for an iterable dataset without a length."""
    try:
        return len(loader)
    except TypeError:
        return None


def _rank() -> tuple[int, int]:

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _SkippedIndices:
    """The index lists of an epoch without its first ``skip``. Started lazily, on the first ``next``,
    exactly as ``DataLoader``'s own iteration starts its sampler (so random draws happen in the same
    order); :meth:`start` forces the start while the epoch's random state is in place."""

    def __init__(self, indices: Any, skip: int) -> None:
        self.indices, self.skip = indices, skip
        self._iterator: Iterator[Any] | None = None

    def __len__(self) -> int:
        return max(len(self.indices) - self.skip, 0)

    def __iter__(self) -> _SkippedIndices:
        return self

    def start(self) -> None:
        if self._iterator is not None:
            return
        iterator = iter(self.indices)
        for _ in range(self.skip):  # index lists only: no sample is loaded
            next(iterator, None)
        # Draw one more so that a sampler's lazy first draw happens now, then put it back.
        first = next(iterator, _END)
        self._iterator = iterator if first is _END else _prepend(first, iterator)

    def __next__(self) -> Any:
        self.start()
        assert self._iterator is not None
        return next(self._iterator)


_END = object()


def _prepend(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


class ResumableDataLoaderMixin:
    """Mixed in front of the user's ``DataLoader`` class by :func:`make_resumable`."""

    _lp_progress: Progress | None
    _lp_resume: dict[str, Any] | None
    _lp_epoch: int
    _lp_consumed: int
    _lp_random_state: dict[str, Any] | None
    _lp_base: type[DataLoader]

    def _lp_init(self, progress: Progress | None) -> None:
        self._lp_progress = progress
        self._lp_resume = None
        self._lp_epoch = 0
        self._lp_consumed = 0
        self._lp_random_state = None

    def __iter__(self) -> Iterator[Any]:
        return self._lp_iterate()

    def _lp_iterate(self) -> Iterator[Any]:
        # A generator: this body runs at the first ``next()``, after Lightning has set the sampler's
        # epoch and made its restart adjustments to the batch progress.
        loader: Any = self
        resume, self._lp_resume = self._lp_resume, None
        if self._lp_progress is not None:
            epoch, done = self._lp_progress()
        elif resume is not None:  # no trainer: continue after the batches this loader had handed out
            epoch, done = resume["epoch"], resume["consumed"]
        else:
            epoch, done = self._lp_epoch, 0
        length = _length(loader)
        if resume is not None and (resume["epoch"] != epoch or (length is not None and done >= length)):
            resume = None  # the checkpoint's epoch was finished: this is a new one
        self._lp_epoch = epoch
        if resume is None:
            self._lp_consumed = 0
            self._lp_random_state = _random_state(loader)
            iterator = super().__iter__()  # type: ignore[misc]
        else:
            self._lp_consumed = done % length if length else done
            self._lp_random_state = resume["random_state"]
            iterator = self._lp_skip(self._lp_consumed, resume["random_state"])
        for batch in iterator:
            self._lp_consumed += 1
            yield batch

    def _lp_skip(self, skip: int, random_state: dict[str, Any]) -> Iterator[Any]:
        """This epoch's iteration as it started (same random state), without its first ``skip`` batches."""
        loader: Any = self
        clone = object.__new__(self._lp_base)  # the user's class, minus this mixin
        clone.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_lp_")})
        clone.__dict__["_iterator"] = None
        # no indices to skip: the batches are read and dropped
        if isinstance(loader.dataset, IterableDataset):
            now = torch.get_rng_state()
            _set_random_state(loader, random_state)
            try:
                iterator = iter(clone)
                for _ in range(skip):
                    if next(iterator, _END) is _END:
                        break
            finally:
                torch.set_rng_state(now)
            return iterator
        attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
        indices = _SkippedIndices(getattr(loader, attribute), skip)
        clone.__dict__[attribute] = indices  # DataLoader refuses to set it once built; this is a copy
        now = torch.get_rng_state()
        _set_random_state(loader, random_state)
        try:
            iterator = iter(clone)
            indices.start()
        finally:
            torch.set_rng_state(now)  # the run's own random state, restored from the checkpoint
        return iterator

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch's iteration is: epoch, batches handed out, and each rank's random state at its start.

        Called on every rank while a checkpoint is assembled (``Trainer.save_checkpoint`` runs on all
        ranks), so the random states are gathered: Lightning writes rank 0's dict only.
        """
        loader: Any = self
        now = {name: g.get_state() for name, g in _generators(loader).items()}
        states = gather_objects({"epoch_start": self._lp_random_state, "generators": now})
        return {"epoch": self._lp_epoch, "consumed": self._lp_consumed, "ranks": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Generators continue from where they were at the save; the epoch in progress is rebuilt at ``iter``."""
        loader: Any = self
        rank, world_size = _rank()
        states = state["ranks"]
        if len(states) == world_size:
            mine = states[rank]
        else:
            if any(not torch.equal(_flat(s), _flat(states[0])) for s in states):
                rank_zero_warn(
                    f"The checkpoint's data loader was iterated by {len(states)} ranks with different random states;"
                    f" resuming on {world_size} ranks with rank 0's. Samplers that draw from the global random"
                    " state may order this epoch's remaining batches differently than the interrupted run."
                )
            mine = states[0]
        generators = _generators(loader)
        for name, value in mine["generators"].items():
            if name in generators:
                generators[name].set_state(value)
        if mine["epoch_start"] is not None:  # else: saved before this loader was iterated
            self._lp_resume = {
                "epoch": state["epoch"],
                "consumed": state["consumed"],
                "random_state": mine["epoch_start"],
            }


def _flat(rank_state: dict[str, Any]) -> torch.Tensor:
    start = rank_state["epoch_start"]
    parts = [] if start is None else [start["torch"], *start["generators"].values()]
    return (
        torch.cat([*parts, *rank_state["generators"].values()])
        if parts or rank_state["generators"]
        else torch.zeros(0)
    )


_CLASSES: dict[type, type] = {}


def _resumable_class(cls: type[DataLoader]) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Resumable{cls.__name__}", (ResumableDataLoaderMixin, cls), {"_lp_base": cls})
    return _CLASSES[cls]


def _torchdata_loader(dataloader: DataLoader) -> bool:
    """torchdata's ``StatefulDataLoader`` (or a subclass): its own state is replaced by this module's."""
    return any(
        cls.__module__.startswith("torchdata.") and cls.__name__ == "StatefulDataLoader"
        for cls in type(dataloader).__mro__
    )


def can_resume(dataloader: object) -> bool:
    """A map-style ``DataLoader`` whose batches come from a sized sampler, not already stateful.

    torchdata's ``StatefulDataLoader`` over a map-style dataset is taken too: its own state counts the
    batches it handed out, which disagrees with Lightning's loop on the exception path (a batch fetched, not
    trained) and is reset when ``fit`` ends, and re-creating its iteration on resume draws from the global
    random state; resumed from those, a run left the uninterrupted one (measured: tests/strategy/
    test_checkpoint_resume.py). This module's state resumes it exactly on every save path.
    """
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader, ResumableDataLoaderMixin):
        return False
    iterable = isinstance(dataloader.dataset, IterableDataset)
    if callable(getattr(dataloader, "state_dict", None)) and (iterable or not _torchdata_loader(dataloader)):
        return False  # stateful already (a torchdata loader over a dataset that keeps its own state: its own)
    # replayed from the epoch's start and the batches already trained dropped (read, not trained)
    if iterable:
        return True
    index_sampler = dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler
    try:
        len(index_sampler)
    except TypeError:
        return False
    return True


def make_resumable(dataloader: object, progress: Progress | None = None) -> object:
    """A stateful shallow copy of ``dataloader`` (see the module docstring); other iterables unchanged.

    ``progress`` returns ``(epoch, batches trained in it)`` as the trainer counts them.
    """
    if not can_resume(dataloader):
        return dataloader
    resumable = object.__new__(_resumable_class(type(dataloader)))
    resumable.__dict__.update(dataloader.__dict__)
    resumable._lp_init(progress)
    return resumable
