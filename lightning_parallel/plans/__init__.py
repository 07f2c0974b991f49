"""Inspect an unmodified model and describe how to shard it (a ``ParallelPlan``).

``ParallelPlan`` itself is defined in ``tensor_parallel/plan.py`` (with the styles it names) and
re-exported here, where users look for it.
"""

from lightning_parallel.plans.auto import auto_plan
from lightning_parallel.plans.user import plan_from_dict
from lightning_parallel.tensor_parallel.plan import ParallelPlan, ShardedContainer

__all__ = ["ParallelPlan", "ShardedContainer", "auto_plan", "plan_from_dict"]
