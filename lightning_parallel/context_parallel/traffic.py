"""Bytes each context-parallel collective sent from this rank: what the benchmark and the tests hold against theory."""

from __future__ import annotations

from collections import Counter


class Traffic:
    """Per-kind byte counts (``ring``, ``all_to_all``, ``all_gather``) since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()

    def add(self, kind: str, num_bytes: int) -> None:
        self.bytes[kind] += num_bytes

    def reset(self) -> None:
        self.bytes.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


TRAFFIC = Traffic()
"""One per process: a rank's collectives run one at a time, from its one training loop."""
