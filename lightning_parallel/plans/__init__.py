"""Inspect an unmodified model and describe how to shard it (a ``ParallelPlan``)."""

from lightning_parallel.plans.auto import auto_plan
from lightning_parallel.plans.plan import ParallelPlan, ShardedContainer
from lightning_parallel.plans.user import plan_from_dict

__all__ = ["ParallelPlan", "ShardedContainer", "auto_plan", "plan_from_dict"]
