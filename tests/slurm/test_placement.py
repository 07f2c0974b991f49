"""Which tensor-parallel groups span nodes, for the rank orders SLURM produces (no cluster needed).

The mesh's tp axis is innermost: groups are runs of consecutive ranks. SLURM's default block
distribution (checked on the local cluster by test_slurm_jobs.py: ranks 0,1 on node1, 2,3 on
node2) keeps them inside nodes; cyclic distribution, or tp larger than a node, does not.
"""

from __future__ import annotations

from lightning_parallel.launch import groups_across_nodes


def _tp_groups(world: int, tp: int) -> list[list[int]]:
    return [list(range(start, start + tp)) for start in range(0, world, tp)]


def test_block_distribution_keeps_groups_inside_nodes() -> None:
    node_of_rank = [rank // 4 for rank in range(8)]  # 2 nodes x 4 tasks, block
    assert groups_across_nodes(node_of_rank, _tp_groups(8, 2)) == []
    assert groups_across_nodes(node_of_rank, _tp_groups(8, 4)) == []


def test_cyclic_distribution_puts_every_group_across_nodes() -> None:
    node_of_rank = [rank % 2 for rank in range(8)]  # --distribution=cyclic over 2 nodes
    assert groups_across_nodes(node_of_rank, _tp_groups(8, 2)) == _tp_groups(8, 2)


def test_tp_larger_than_a_node_or_not_dividing_it() -> None:
    block = [rank // 4 for rank in range(8)]
    assert groups_across_nodes(block, _tp_groups(8, 8)) == [list(range(8))]
    uneven = [rank // 3 for rank in range(6)]  # 2 nodes x 3 tasks, tp=2: the group {2, 3} crosses
    assert groups_across_nodes(uneven, _tp_groups(6, 2)) == [[2, 3]]


def test_one_node_never_crosses() -> None:
    assert groups_across_nodes([0] * 4, _tp_groups(4, 4)) == []
