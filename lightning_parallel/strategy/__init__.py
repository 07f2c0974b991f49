"""The Lightning strategy that composes the parallelisms."""

from lightning_parallel.strategy.hybrid import HybridParallelStrategy

__all__ = ["HybridParallelStrategy"]
