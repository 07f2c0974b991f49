"""Host memory the deferred offload updates hold, beside what FSDP2 offloads (``offload_update`` other than exact).

Read from what ``zero/delayed_update.py`` and ``zero/importance_split.py`` keep between two steps;
``tests/planner/test_host_updates.py`` holds the formula to the bytes a run's update objects hold.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["deferred_update_bytes"]


def deferred_update_bytes(
    update: Any, shard: int, matrices: int, matrix_rows: int, param_bytes: int, grad_bytes: int
) -> int:
    """Host bytes a deferred update holds between two steps, beside FSDP2's offloaded shards and states.

    ``"delayed"`` (``zero/delayed_update.py``): the next parameters, computed into a copy of each host shard, and
    the gradients the worker reads, which it holds while the next backward makes new ones. An
    :class:`~lightning_parallel.zero.arguments.ImportanceSplit` (``zero/importance_split.py``): the matrices'
    gradients its worker reads, and the other rows' fp32 gradient sum until a flush, then their new values until
    the next step installs them (one or the other: ``1 - top_rows`` of each matrix's rows), and the indices of
    each matrix's chosen and other rows (int64; at a flush that chooses the rows again, the update in flight
    still holds the previous selection's other rows). ``shard``: the rank's offloaded elements; ``matrices``: those of
    parameters of two or more dimensions, ``matrix_rows`` their rows on this rank. During a flush the
    worker also holds, for a moment, the sum's mean and the rows' moments (three more of the other rows' fp32
    size): not counted.
    """
    if update == "delayed":
        return shard * (param_bytes + grad_bytes)
    others = math.ceil((1.0 - update.top_rows) * matrices)
    # a flush that chooses again: both selections
    other_rows = math.ceil((1.0 - update.top_rows) * matrix_rows)
    return matrices * grad_bytes + others * 4 + (matrix_rows + other_rows) * 8
