"""How a job is started and stopped by a cluster scheduler: SLURM requeue, rank placement."""

from lightning_parallel.launch.placement import check_tensor_parallel_placement, groups_across_nodes
from lightning_parallel.launch.slurm import SLURMAutoRequeue

__all__ = ["SLURMAutoRequeue", "check_tensor_parallel_placement", "groups_across_nodes"]
