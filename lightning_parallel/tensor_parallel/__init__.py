"""Apply the tensor- and sequence-parallel part of a plan (Megatron-style, on DTensor styles)."""

from lightning_parallel.tensor_parallel.apply import apply_tensor_parallel
from lightning_parallel.tensor_parallel.captured_inputs import BlockInputCapture, capture_block_inputs
from lightning_parallel.tensor_parallel.plan import ParallelPlan, ShardedContainer
from lightning_parallel.tensor_parallel.styles import ColwiseProjection, RowwiseProjection
from lightning_parallel.tensor_parallel.verify import verify_and_choose_modes

__all__ = [
    "BlockInputCapture",
    "ColwiseProjection",
    "ParallelPlan",
    "RowwiseProjection",
    "ShardedContainer",
    "apply_tensor_parallel",
    "capture_block_inputs",
    "verify_and_choose_modes",
]
