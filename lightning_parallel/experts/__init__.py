"""Mixture-of-Experts: the MoE layer, expert parallelism, and MoE blocks of foreign models.

One concept per file:

- ``router``: routing maths as pure functions (top-k, capacity, queue positions, aux losses).
- ``experts``: expert MLPs as stacked weights, computed with grouped matmuls.
- ``dispatch``: tokens to their experts and back (all-to-all over an expert-parallel group);
  the only file that communicates.
- ``layer``: ``MoE``, composing the three; ``moe_aux_loss`` for training steps.
- ``detection``: ``find_moe_blocks``, the MoE blocks of unchanged models by their structure.
- ``foreign``, ``prescaled``, ``grouped_linear``: expert parallelism for each kind of those blocks.
- ``parallel``: ``ExpertParallel.apply`` and ``expert_parameters``.
- ``aux_loss``: ``AuxLossCollector``, the auxiliary losses of unchanged models, counted once.

See docs/experts.md.
"""

from lightning_parallel.experts.aux_loss import AuxLossCollector
from lightning_parallel.experts.detection import MoEBlockInfo, find_moe_blocks
from lightning_parallel.experts.experts import GroupedExperts, grouped_mm
from lightning_parallel.experts.layer import MoE, SharedExpert, moe_aux_loss, moe_layers
from lightning_parallel.experts.parallel import (
    ExpertParallel,
    ExpertShard,
    expert_parameters,
    expert_shard,
    reduce_expert_gradients,
)
from lightning_parallel.experts.router import (
    Router,
    Routing,
    expert_capacity,
    load_balancing_loss,
    queue_positions,
    route_topk,
    router_z_loss,
)

__all__ = [
    "AuxLossCollector",
    "ExpertParallel",
    "ExpertShard",
    "GroupedExperts",
    "MoE",
    "MoEBlockInfo",
    "Router",
    "Routing",
    "SharedExpert",
    "expert_capacity",
    "expert_parameters",
    "expert_shard",
    "find_moe_blocks",
    "grouped_mm",
    "load_balancing_loss",
    "moe_aux_loss",
    "moe_layers",
    "queue_positions",
    "reduce_expert_gradients",
    "route_topk",
    "router_z_loss",
]
