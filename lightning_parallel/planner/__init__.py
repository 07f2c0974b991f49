"""Predict memory per rank and step time of a layout on a cluster, and search layouts; no processes.

See docs/planner.md. The model is the user's unchanged module (built on the meta device for large
ones), read as numbers by :func:`describe`; a :class:`Layout` is the strategy's arguments.
"""

from lightning_parallel.planner.cluster import CLUSTERS, Cluster, load_cluster
from lightning_parallel.planner.layout import Layout, layout_problems
from lightning_parallel.planner.memory import RankMemory, rank_memory
from lightning_parallel.planner.search import Candidate, SearchResult, search
from lightning_parallel.planner.shapes import BlockShape, ModelShape, describe
from lightning_parallel.planner.timing import StepTime, step_time

__all__ = [
    "CLUSTERS",
    "BlockShape",
    "Candidate",
    "Cluster",
    "Layout",
    "ModelShape",
    "RankMemory",
    "SearchResult",
    "StepTime",
    "describe",
    "layout_problems",
    "load_cluster",
    "rank_memory",
    "search",
    "step_time",
]
