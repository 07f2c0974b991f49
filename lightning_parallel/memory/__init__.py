"""Activation memory savers: checkpointing (recompute), offload to host memory, compression.

- :mod:`.checkpointing`: ``"full"`` and ``"selective"`` recomputation applied to unchanged modules.
- :mod:`.saved_tensors`: activations saved for backward kept in host memory and/or in bf16/fp8.
- :mod:`.counting`: exact byte counts of what a step holds for its backward pass.
- :mod:`.monitor`: a Lightning callback that reports those bytes for the strategy's runs.
"""

from lightning_parallel.memory.checkpointing import (
    CheckpointingConfig,
    apply_activation_checkpointing,
    is_checkpointed,
    select_modules,
)
from lightning_parallel.memory.counting import ActivationBytes, SavedTensorCounter, counting
from lightning_parallel.memory.monitor import ActivationMemoryMonitor
from lightning_parallel.memory.saved_tensors import COMPRESSIONS, ActivationSaver, saved_tensors_context

__all__ = [
    "COMPRESSIONS",
    "ActivationBytes",
    "ActivationMemoryMonitor",
    "ActivationSaver",
    "CheckpointingConfig",
    "SavedTensorCounter",
    "apply_activation_checkpointing",
    "counting",
    "is_checkpointed",
    "saved_tensors_context",
    "select_modules",
]
