"""The strategy's configuration: grouped dataclasses (``parallel_config.py``) and every check (``validation.py``)."""

from lightning_parallel.config.parallel_config import (
    PIPELINE_BOUNDARIES_KEY,
    ExpertConfig,
    MemorySaverConfig,
    ParallelConfig,
    PathLike,
    PlanArg,
    TensorParallelConfig,
)

__all__ = [
    "PIPELINE_BOUNDARIES_KEY",
    "ExpertConfig",
    "MemorySaverConfig",
    "ParallelConfig",
    "PathLike",
    "PlanArg",
    "TensorParallelConfig",
]
