"""Validate parallel degrees against the world size and build the one named DeviceMesh."""

from lightning_parallel.mesh.parallel_dims import AXIS_NAMES, Axis, ParallelDims

__all__ = ["AXIS_NAMES", "Axis", "ParallelDims"]
