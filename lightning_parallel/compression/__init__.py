"""Making a trained model cheaper under any layout: pruning (more to come: quantization, distillation).

- :class:`MagnitudePruning`: a Lightning callback; one global magnitude threshold over the shards of
  all ranks, or 2:4 semi-structured masks; gradual schedules; masks re-applied after every
  optimizer step, carried by checkpoints and ``export`` as zeros.
"""

from lightning_parallel.compression.pruning import MagnitudePruning
from lightning_parallel.compression.schedule import PruningSchedule
from lightning_parallel.compression.threshold import kth_smallest_magnitude

__all__ = ["MagnitudePruning", "PruningSchedule", "kth_smallest_magnitude"]
