"""Synchronous data parallelism: hooked replication (DDP's reducer, FSDP2's ``replicate``) and explicit reductions.

- ``replicate``: :func:`apply_data_parallel` (gradients averaged over ``dp`` inside backward),
  :func:`no_gradient_sync` for accumulation, :func:`average_direct_parameters`.
- ``gradient_sync``: :class:`GradientGroup`, :class:`GradientScale` and :class:`GradientSync`,
  the bucketed all-reduces after backward for pipelines and sharded experts.

Which of the two a layout uses, and how, is decided in one place: ``parallelize/reductions.py``.
"""

from lightning_parallel.data_parallel.gradient_sync import (
    GradientGroup,
    GradientScale,
    GradientSync,
    all_reduce_gradients,
)
from lightning_parallel.data_parallel.replicate import (
    apply_data_parallel,
    average_direct_parameters,
    no_gradient_sync,
)

__all__ = [
    "GradientGroup",
    "GradientScale",
    "GradientSync",
    "all_reduce_gradients",
    "apply_data_parallel",
    "average_direct_parameters",
    "no_gradient_sync",
]
