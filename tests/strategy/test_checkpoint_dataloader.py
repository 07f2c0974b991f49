"""The resumable training loader (``lightning_parallel/checkpoint/dataloader.py``) without processes.

A loader is iterated for ``k`` batches, its state taken (as Lightning does when it assembles a
checkpoint) together with the global random state, the random state is then scrambled and the
state loaded into a fresh copy of the user's loader: the rest of the epoch must be exactly the
batches the uninterrupted iteration gave, and the data of the skipped batches is never loaded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from lightning_parallel.checkpoint.dataloader import make_resumable


class CountingData(Dataset):
    """Sample ``i`` is ``i``; records which samples were loaded."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded.append(i)
        return torch.tensor(i)


def _loaders() -> dict[str, DataLoader]:
    data = CountingData(20)
    return {
        "random_sampler": DataLoader(data, batch_size=3, shuffle=True),
        "own_generator": DataLoader(
            data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5)
        ),
        "distributed_sampler": DataLoader(
            data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
        ),
        "sequential": DataLoader(data, batch_size=4),
        "no_auto_collation": DataLoader(data, batch_size=None, sampler=RandomSampler(data)),
    }


def _epoch(loader: DataLoader, epoch: int, progress: list[int]) -> list[list[int]]:
    """One epoch as Lightning runs it: ``set_epoch``, then batches, the progress counted by the trainer."""
    sampler = loader.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    progress[:] = [epoch, 0]
    batches = []
    for batch in loader:
        batches.append(torch.atleast_1d(batch).tolist())
        progress[1] += 1
    return batches


@pytest.mark.parametrize("kind", list(_loaders()))
@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_a_resumed_epoch_continues_with_the_next_batch(kind: str, stop_after: int) -> None:
    torch.manual_seed(0)
    user_loader = _loaders()[kind]
    pristine = copy.deepcopy(user_loader)  # what a fresh process builds
    progress = [0, 0]
    loader = make_resumable(user_loader, lambda: (progress[0], progress[1]))
    straight = [_epoch(loader, epoch, progress) for epoch in range(3)]

    # The same run again, interrupted after `stop_after` batches of epoch 1.
    torch.manual_seed(0)
    fresh = copy.deepcopy(pristine)
    loader = make_resumable(fresh, lambda: (progress[0], progress[1]))
    assert _epoch(loader, 0, progress) == straight[0]
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(1)
    progress[:] = [1, 0]
    iterator = iter(loader)
    for _ in range(stop_after):
        next(iterator)
        progress[1] += 1
    state, rng = loader.state_dict(), torch.get_rng_state()

    torch.manual_seed(12345)  # a new process: another random state, a pristine loader
    resumed_source = copy.deepcopy(pristine)
    resumed_source.dataset.loaded.clear()
    resumed = make_resumable(resumed_source, lambda: (progress[0], progress[1]))
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)  # the strategy restores each rank's random state from the checkpoint
    if hasattr(resumed.sampler, "set_epoch"):
        resumed.sampler.set_epoch(1)
    rest = [torch.atleast_1d(b).tolist() for b in resumed]
    assert rest == straight[1][stop_after:]
    skipped = {i for batch in straight[1][:stop_after] for i in batch}
    assert not skipped & set(resumed_source.dataset.loaded[: sum(map(len, rest))]), (
        "skipped batches were loaded"
    )
    progress[1] = len(straight[1])
    assert _epoch(resumed, 2, progress) == straight[2]  # and the next epoch as in the uninterrupted run


def test_which_loaders_are_wrapped() -> None:
    """Map-style loaders with a sized sampler, and iterable ones (replayed on resume); not other iterables,
    nor a loader that keeps its own state."""
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(3)

    stream = DataLoader(Stream(), batch_size=2)
    assert make_resumable(stream) is not stream
    assert make_resumable([1, 2, 3]) == [1, 2, 3]
    plain = DataLoader(CountingData(4), batch_size=2)
    wrapped = make_resumable(plain)
    assert isinstance(wrapped, DataLoader) and wrapped is not plain and len(wrapped) == 2
    assert make_resumable(wrapped) is wrapped  # already stateful


def test_an_iterable_loader_resumes_after_the_batches_it_handed_out() -> None:
    """The epoch replayed from the random state it started with, the batches already handed out dropped."""
    from torch.utils.data import IterableDataset

    class Shuffled(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from torch.randperm(10).tolist()  # the order drawn when the iteration starts

    torch.manual_seed(0)
    loader = make_resumable(DataLoader(Shuffled(), batch_size=2))
    iterator = iter(loader)
    first = [next(iterator).tolist() for _ in range(2)]
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest = [b.tolist() for b in iterator]
    resumed = make_resumable(DataLoader(Shuffled(), batch_size=2))
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert [b.tolist() for b in resumed] == rest and len(first) + len(rest) == 5


def test_without_a_trainer_the_loader_counts_its_own_batches() -> None:
    torch.manual_seed(0)
    pristine = DataLoader(CountingData(10), batch_size=2, shuffle=True)
    loader = make_resumable(copy.deepcopy(pristine))
    iterator = iter(loader)
    first = [next(iterator).tolist() for _ in range(2)]
    state, rng = loader.state_dict(), torch.get_rng_state()
    rest = [b.tolist() for b in iterator]
    resumed = make_resumable(copy.deepcopy(pristine))
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert [b.tolist() for b in resumed] == rest and len(first) + len(rest) == 5
