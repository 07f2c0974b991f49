"""Which blocks each pipeline stage holds: contiguous runs, balanced or given by the user."""

from __future__ import annotations

from collections.abc import Sequence, Set


def balanced_boundaries(
    costs: Sequence[int | float], num_stages: int, forbidden: Set[int] = frozenset()
) -> list[int]:
    """First block index of every stage, minimising the largest stage cost (exact, by dynamic programming).

    Costs are per block (parameter counts by default). Identical blocks get equal counts; the
    remainder goes to the later stages, which hold the fewest activations under 1F1B. ``forbidden``: block
    indices no stage may start at (state handed between blocks: ``handed_state.py``); a ``ValueError`` where
    no split avoids them.
    """
    n = len(costs)
    check_stage_count(n, num_stages)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))

    def span(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    # best[s][j]: the smallest possible maximum cost when the first j blocks form s stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            # "<" keeps the earliest cut among equals: earlier stages get fewer blocks.
            for i in range(s - 1, j):
                if i in forbidden and i > 0:
                    continue
                value = max(best[s - 1][i], span(i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    if best[num_stages][n] == inf:
        raise ValueError(
            f"no split of {n} blocks into {num_stages} stages starts none at {sorted(forbidden)}"
        )
    starts, j = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][j]
        starts.append(j)
    return sorted(starts)


def check_stage_count(num_blocks: int, num_stages: int) -> None:
    if num_stages > num_blocks:
        raise ValueError(
            f"The pipeline has {num_stages} stages (`pipeline_parallel` x stages per rank) but the model has"
            f" only {num_blocks} blocks: every stage needs at least one block. Lower `pipeline_parallel`"
            " or `pipeline_virtual_stages`, or use a deeper model."
        )


def check_user_boundaries(starts: Sequence[int], num_blocks: int, num_stages: int) -> list[int]:
    """Validate ``plan={"pipeline_boundaries": [...]}``: the first block index of stages 1..S-1."""
    check_stage_count(num_blocks, num_stages)
    bounds = [0, *starts]
    if len(bounds) != num_stages:
        raise ValueError(
            f"`pipeline_boundaries={list(starts)}` gives {len(bounds)} stages but the layout has {num_stages}:"
            f" list the first block index of stages 1..{num_stages - 1} ({num_stages - 1} numbers)."
        )
    if (
        any(not isinstance(b, int) for b in starts)
        or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))
        or (bounds[-1] >= num_blocks)
    ):
        raise ValueError(
            f"`pipeline_boundaries={list(starts)}` must be strictly increasing block indices between 1 and"
            f" {num_blocks - 1} (the model has {num_blocks} blocks), so that every stage holds at least one block."
        )
    return bounds


def stage_ranges(starts: Sequence[int], num_blocks: int) -> list[range]:
    ends = [*starts[1:], num_blocks]
    return [range(a, b) for a, b in zip(starts, ends, strict=True)]
