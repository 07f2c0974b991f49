"""Do the tensor-parallel groups of the mesh stay inside one node?

The mesh puts ``tp`` innermost (``lightning_parallel.mesh``): a tensor-parallel group is a run
of ``tensor_parallel`` consecutive global ranks. Whether those ranks share a node is decided by
the launcher, not by us. Lightning numbers ranks node by node (``node_rank x devices +
local_rank``); SLURM numbers them by its task distribution, which is ``block`` by default
(tasks 0..n-1 on the first node), so the groups stay inside nodes when ``tensor_parallel``
divides the tasks per node. ``--distribution=cyclic`` (rank 0 on node 0, rank 1 on node 1, ...)
or a ``tensor_parallel`` larger than a node puts every group across nodes.

A group across nodes still computes the right thing, only slowly: tensor parallelism
communicates inside every layer, and the inter-node links are the slow ones. Some systems
have fast links across nodes (NVLink domains larger than a node, e.g. GB200 NVL72), where
this is a deliberate choice; so it is a warning, not an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_parallel.mesh import Axis


def groups_across_nodes(node_of_rank: Sequence[int], groups: Iterable[Sequence[int]]) -> list[list[int]]:
    """The groups (lists of global ranks) whose ranks are not all on one node."""
    return [list(group) for group in groups if len({node_of_rank[rank] for rank in group}) > 1]


def check_tensor_parallel_placement(strategy: Any) -> list[list[int]]:
    """Warn (on rank 0) when a tensor-parallel group of ``strategy``'s mesh spans nodes.

    Every rank must call this together, after the mesh exists: the node of each rank is
    known only to that rank (Lightning's ``cluster_environment.node_rank()``: ``SLURM_NODEID``
    under SLURM, ``GROUP_RANK``/``NODE_RANK`` under torchrun), so they are gathered once, in the
    strategy's ``setup_environment``. Returns the groups that span nodes (empty when all is well).
    """
    mesh = strategy.device_mesh
    if not mesh.mesh_dim_names or mesh.mesh_dim_names[-1] != Axis.TP:
        return []  # not our mesh (e.g. Lightning's ModelParallelStrategy): its axes mean other things
    tensor_parallel = mesh[Axis.TP].size()
    if tensor_parallel == 1 or not torch.distributed.is_initialized():
        return []
    node_of_rank: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(node_of_rank, strategy.cluster_environment.node_rank())
    groups = mesh.mesh.reshape(-1, tensor_parallel).tolist()
    crossing = groups_across_nodes(node_of_rank, groups)
    if crossing:
        shown = "; ".join(f"ranks {g} on nodes {[node_of_rank[r] for r in g]}" for g in crossing[:4])
        rank_zero_warn(
            f"{type(strategy).__name__}: {len(crossing)} of {len(groups)} tensor-parallel groups span nodes"
            f" ({shown}). Tensor parallelism communicates inside every layer, so across nodes it is slow."
            f" Choose `tensor_parallel={tensor_parallel}` to divide the processes per node (Trainer `devices`),"
            " and under SLURM keep the default block task distribution (not `--distribution=cyclic`)."
        )
    return crossing
