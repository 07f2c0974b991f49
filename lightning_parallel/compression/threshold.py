"""The magnitude below which a given number of weights of the whole model lie, found with collectives.

A threshold computed on each rank's shard prunes each shard to the target sparsity, which is not
what global magnitude pruning means (a layer whose weights are small overall should lose more of
them), and it changes with the layout. Gathering every magnitude to one rank costs the model's
size in memory. Instead the threshold is found by bisection on the bit patterns of non-negative
float32 numbers (ordered like the numbers): each probe counts, over the whole model, the weights
at or below a candidate (:class:`~lightning_parallel.precision.layout_sum.LayoutSum`), 31 probes
of a few scalars each. The result is the exact k-th smallest magnitude, the same for every layout
that holds the same weights, and the same as one process computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_parallel.precision.layout_sum import LayoutSum

__all__ = ["kth_smallest_magnitude"]

_INF_BITS = 0x7F800000  # float32 +inf: every finite magnitude lies at or below it


def _as_float(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32).item())


def kth_smallest_magnitude(magnitudes: Sequence[Tensor], count: LayoutSum, k: int) -> float:
    """The smallest ``t`` with at least ``k`` of all ranks' ``magnitudes`` (float32, >= 0) at or below it.

    ``magnitudes[i]`` is the local values of ``count.params[i]``; every rank calls this together.
    """
    low, high = -1, _INF_BITS  # count(low) < k <= count(high)
    while high - low > 1:
        middle = (low + high) // 2
        threshold = _as_float(middle)
        below = count([m <= threshold for m in magnitudes])
        if float(below[0]) >= k:
            high = middle
        else:
            low = middle
    return _as_float(high)
