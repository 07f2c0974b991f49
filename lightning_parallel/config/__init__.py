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
from lightning_parallel.config.strategy_arguments import StrategyArguments

__all__ = [
    "PIPELINE_BOUNDARIES_KEY",
    "ExpertConfig",
    "MemorySaverConfig",
    "ParallelConfig",
    "PathLike",
    "PlanArg",
    "StrategyArguments",
    "TensorParallelConfig",
]
