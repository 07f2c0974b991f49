"""The ordered recipe that parallelizes an unchanged module, and what it returns.

- :func:`parallelize` (``recipe.py``): the steps in order, each a function with explicit arguments
  (``tensor_parallel_step``, ``pipeline_step``, ``experts_step``, ``memory_step``, ``zero_sharding``,
  ``gradients``).
- :func:`decide_gradient_reductions` (``reductions.py``): which gradient reductions a layout runs, from
  its configuration alone; ``gradients.py`` installs them.
- :class:`Parallelized` (``result.py``): what the strategy's Lightning hooks need.
- :class:`SampledStep` (``sample.py``): the one run of the user's step at setup.

Nothing here knows Lightning's Trainer: every step can be called, and tested, on a plain module
with a mesh.
"""

from lightning_parallel.parallelize.gradients import GradientReductions, plan_gradient_reductions
from lightning_parallel.parallelize.recipe import compile_blocks, parallelize, sync_parameters
from lightning_parallel.parallelize.reductions import Reduction, decide_gradient_reductions
from lightning_parallel.parallelize.result import Parallelized, recall
from lightning_parallel.parallelize.sample import SampledStep, StepProbe

__all__ = [
    "GradientReductions",
    "Parallelized",
    "Reduction",
    "SampledStep",
    "StepProbe",
    "compile_blocks",
    "decide_gradient_reductions",
    "parallelize",
    "plan_gradient_reductions",
    "recall",
    "sync_parameters",
]
