"""Pairs of features that cannot train correctly together: refused by name, before launch.

Silently training a different layout than the user asked for is worse than an error that names
the arguments, the reason and the nearest supported layout (docs/compatibility.md). The ZeRO
combinations are checked in ``strategy/zero.py`` next to the code that explains them.
"""

from __future__ import annotations


def check_layout_pairs(*, tensor_parallel: int, sequence_parallel: bool, expert_parallel: int) -> None:
    """Refuse pairs of features that cannot train correctly together (docs/compatibility.md), by name.

    Called inside ``Trainer(...)``, once ``tensor_parallel='auto'`` is resolved and before any
    process is launched, so the user reads the reason instead of a failed plan verification on
    every rank.
    """
    if sequence_parallel and tensor_parallel > 1 and expert_parallel > 1:
        raise ValueError(
            f"HybridParallelStrategy(`sequence_parallel=True`, `tensor_parallel={tensor_parallel}`,"
            f" `expert_parallel={expert_parallel}`) is not supported: under sequence parallelism each"
            " tensor-parallel rank holds a slice of the sequence, and the MoE blocks (which tensor parallelism"
            " does not shard) would route only their rank's tokens, so expert capacity, drops and the"
            " load-balancing loss would differ from the unsharded model. Nearest supported layouts:"
            f" `sequence_parallel=False` with `tensor_parallel={tensor_parallel}` and"
            f" `expert_parallel={expert_parallel}`, or `sequence_parallel=True` with `expert_parallel=1`."
        )
