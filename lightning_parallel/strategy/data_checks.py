"""Training data that would hang or break a parallel run, refused when training starts, on every rank alike.

- Ranks with different numbers of batches per epoch (a user's own sampler or per-rank datasets): the
  rank with fewer batches starts its next epoch, or leaves ``fit``, while the others still wait in a
  step's collectives (a hang until the collective timeout). Lightning's own ``DistributedSampler``
  never does this; one all-gather of one number when training starts tells.
- Under pipeline parallelism, a last batch smaller than the others: the stages are built for one
  batch size, so the epoch's last step would fail inside a stage on one rank. Known from the
  loader's length and ``drop_last`` before the first step, instead of after the first epoch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.comm.agreement import communication_device


def check_training_data(trainer: Any, *, pipelined: bool) -> None:
    """Both checks below, when training starts."""
    check_equal_batches(trainer)
    if pipelined:
        check_pipeline_batches(trainer)


def check_equal_batches(trainer: Any) -> None:
    """Every rank must train on as many batches per epoch (``trainer.num_training_batches``)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    batches = trainer.num_training_batches
    count = -1 if batches is None or math.isinf(batches) else int(batches)  # -1: not known (iterable data)
    mine = torch.tensor([count], dtype=torch.int64, device=communication_device(None))
    counts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, mine)
    known = {int(c.item()) for c in counts} - {-1}
    if len(known) > 1:
        per_rank = ", ".join(f"rank {r}: {int(c.item())}" for r, c in enumerate(counts))
        raise ValueError(
            f"The ranks train on different numbers of batches per epoch ({per_rank}). A rank that runs out"
            " first would leave the others waiting in a collective until the timeout. Let Lightning place a"
            " DistributedSampler (`use_distributed_sampler=True`, the default), or give every rank a sampler of"
            " the same length (e.g. your own with `**trainer.strategy.distributed_sampler_kwargs`)."
        )


def check_pipeline_batches(trainer: Any) -> None:
    """Under pipeline parallelism every batch must have one size: no smaller last batch."""
    loader = trainer.train_dataloader
    batch_size, drop_last = getattr(loader, "batch_size", None), getattr(loader, "drop_last", True)
    sampler = getattr(loader, "sampler", None)
    if not batch_size or drop_last or sampler is None:
        return
    try:
        samples = len(sampler)
    except TypeError:  # an iterable: its batches are checked as they come (pipeline/microbatch.py)
        return
    if samples % batch_size:
        raise ValueError(
            f"Pipeline parallelism: each epoch's last training batch holds {samples % batch_size} samples (the"
            f" sampler gives {samples} per rank in batches of {batch_size}), but the pipeline stages are built"
            " for one batch size. Pass `drop_last=True` to the DataLoader, or a dataset length that the batch"
            " size divides."
        )
