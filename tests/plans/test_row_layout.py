"""Row layouts (``tensor_parallel/row_layout.py``): which user rows each rank stores, and the way back.

No processes: the layouts of Phi-3's fused q|k|v (unequal widths) and of k/v heads fewer than ranks,
their inverse, the summed gradient of rows held twice, the weighting that counts such a row once in
a norm; and the planner choosing them.
"""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.plans.attention import fused_layouts, local_kv_heads
from lightning_parallel.tensor_parallel.row_layout import RowLayout

HEAD = 2  # rows per head in these examples


def _qkv(heads: int, kv_heads: int, ranks: int) -> RowLayout:
    return RowLayout.of_blocks(
        [(heads * HEAD, heads), (kv_heads * HEAD, kv_heads), (kv_heads * HEAD, kv_heads)], ranks
    )


def test_unequal_fused_rows_give_each_rank_its_heads_of_each_block() -> None:
    layout = _qkv(heads=4, kv_heads=2, ranks=2)  # q rows 0-7, k 8-11, v 12-15
    assert layout.index == (0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15)
    assert not layout.duplicated and layout.per_rank == 8
    user = torch.arange(16.0).view(16, 1)
    assert torch.equal(layout.user(layout.stored(user)), user)
    assert torch.equal(layout.summed(layout.stored(user)), user)  # no copies: the sum is the user's tensor


def test_fewer_kv_heads_than_ranks_store_a_head_on_several_ranks() -> None:
    layout = _qkv(heads=4, kv_heads=1, ranks=2)  # multi-query: one k and one v head
    assert layout.index == (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)
    assert layout.duplicated
    assert layout.copies.tolist() == [1, 1, 1, 1, 2, 2, 2, 2] * 2
    shares = torch.ones(16, 3)  # each rank's share of a gradient: a row held twice gets two shares
    assert layout.summed(shares)[:, 0].tolist() == [1.0] * 8 + [2.0] * 4
    # Counted once in a norm: each copy of a row held twice weighs half (p = 2).
    local = torch.ones(8, 3)
    assert float(layout.measured(local, 2.0, rank=0).pow(2).sum()) == pytest.approx(4 * 3 + 4 * 3 / 2)
    assert torch.equal(layout.measured(local, float("inf"), rank=0), local)


def test_kv_heads_on_four_ranks() -> None:
    layout = RowLayout.of_blocks([(2 * HEAD, 2)], 4)  # 2 k heads over 4 ranks: each on two
    assert layout.index == (0, 1, 0, 1, 2, 3, 2, 3)
    assert local_kv_heads(2, 4) == 1 and local_kv_heads(8, 4) == 2


def test_blocks_that_cannot_be_split_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        RowLayout.of_blocks([(6, 3)], 4)


def test_the_planner_offers_the_layouts_of_a_fused_projection_in_order() -> None:
    equal = [label for label, _ in fused_layouts("qkv", 3 * 4 * 16, 4, 4, 16, 2)]
    assert equal == ["q|k|v", "per head", "2 groups of q|k|v", "4 groups of q|k|v"]
    grouped = [label for label, _ in fused_layouts("qkv", (4 + 2 * 2) * 16, 4, 2, 16, 2)]
    assert grouped == ["per k/v group", "q|k|v blocks"]
    multi_query = [label for label, _ in fused_layouts("c_attn", (4 + 2) * 16, 4, 1, 16, 2)]
    assert multi_query == ["q|k|v blocks"]  # a k/v group cannot be split over two ranks
    with pytest.raises(ValueError, match="unequal widths"):
        fused_layouts("qkv", 100, 4, 2, 16, 2)


def test_fused_parts_as_rows_store_what_a_strided_shard_holds() -> None:
    """torch before 2.13 stores a fused q|k|v (3 equal parts) as a row layout: rank r's rows are its slice of
    each part, the local tensor ``_StridedShard(0, split_factor=3)`` gives on 2.13."""
    from lightning_parallel.tensor_parallel.styles import fused_rows

    layout = fused_rows(12, 3, 2)  # q rows 0-3, k 4-7, v 8-11
    assert layout.index == (0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11)
    assert not layout.duplicated and layout.per_rank == 6
    user = torch.arange(12.0)
    for rank in range(2):
        strided = torch.cat([part.chunk(2)[rank] for part in user.chunk(3)])
        assert torch.equal(layout.stored(user).chunk(2)[rank], strided)
    with pytest.raises(ValueError, match="fused projection of 9 rows in 3 parts cannot be split over 2"):
        fused_rows(9, 3, 2)


def test_fused_projection_stored_as_rows_on_torch_before_2_13(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only where torch cannot run ``_StridedShard`` (or the tests ask for it); both ZeRO engines keep it
    (``checkpoint/zero.py`` saves the user's rows under DeepSpeed's engine too)."""
    from lightning_parallel.compat import FUSED_AS_ROWS_ENV, TORCH_VERSION
    from lightning_parallel.parallelize.tensor_parallel_step import check_row_layouts
    from lightning_parallel.tensor_parallel.plan import ParallelPlan
    from lightning_parallel.tensor_parallel.styles import ColwiseProjection

    plan = ParallelPlan(tensor_parallel=2, sequence_parallel=False)
    style = plan.styles["attn.qkv"] = ColwiseProjection(num_chunks=3, use_local_output=True)
    assert not ColwiseProjection(use_local_output=True).fused_as_rows
    monkeypatch.setenv(FUSED_AS_ROWS_ENV, "1")
    assert style.fused_as_rows
    for engine in ("fsdp2", "deepspeed"):
        check_row_layouts(plan, engine)
    monkeypatch.delenv(FUSED_AS_ROWS_ENV)
    assert style.fused_as_rows == (TORCH_VERSION < (2, 13))


def test_a_weight_deepspeed_holds_as_its_local_shard_keeps_its_row_layout() -> None:
    """Under DeepSpeed's engine a tensor-parallel weight is its local shard behind a parametrization
    (``zero/tensor_parallel.py``); the weight the module sees still names its row layout, so whatever reads
    the user's rows (the parity harness, norms) finds it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_parallel.tensor_parallel.row_layout import ROW_LAYOUT, row_layout
    from lightning_parallel.tensor_parallel.styles import fused_rows
    from lightning_parallel.zero.tensor_parallel import local_shard_parameters

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        layer = torch.nn.Linear(4, 12)
        layout = fused_rows(12, 3, 1)
        weight = torch.nn.Parameter(distribute_tensor(layout.stored(layer.weight.detach()), mesh, [Shard(0)]))
        setattr(weight, ROW_LAYOUT, layout)
        layer.weight = weight
        assert local_shard_parameters(layer) == 1
        assert row_layout(layer.weight) == layout and row_layout(layer.bias) is None
    finally:
        if started:
            dist.destroy_process_group()


def _codegen_heads(qkv_rows: torch.Tensor, groups: int, heads: int) -> list[torch.Tensor]:
    """CodeGen's split of a fused projection's output (here its rows): ``groups`` groups (a constant of the
    model, ``mp_num``) of q|v|k, each part flattened over the groups into ``heads`` heads."""
    parts = qkv_rows.reshape(groups, 3, -1)  # per group: its q, v and k rows
    return [parts[:, s].reshape(heads, -1) for s in range(3)]


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_fused_rows_give_each_rank_its_heads_through_the_model_s_own_split(groups: int) -> None:
    """Each rank runs CodeGen's split (``groups`` fixed, its heads halved) on its stored rows and gets the
    heads of the user's split that are its own; the negative control, a rank's contiguous block of rows
    (the ``per head`` layout), gives other rows."""
    heads, head_dim, ranks = 4, 4, 2
    user = torch.arange(3.0 * heads * head_dim)
    wanted = _codegen_heads(user, groups, heads)
    layout = RowLayout.of_groups(user.numel(), groups, 3, ranks)
    plain = user.chunk(ranks)
    for rank in range(ranks):
        mine = [part[rank * heads // ranks : (rank + 1) * heads // ranks] for part in wanted]
        local = _codegen_heads(layout.stored(user).chunk(ranks)[rank], groups, heads // ranks)
        assert all(torch.equal(a, b) for a, b in zip(local, mine, strict=True))
        contiguous = _codegen_heads(plain[rank], groups, heads // ranks)
        assert not all(torch.equal(a, b) for a, b in zip(contiguous, mine, strict=True))
    assert torch.equal(layout.user(layout.stored(user)), user)


def _paired(q: torch.Tensor, heads: int) -> torch.Tensor:
    """Differential attention's pairing: head ``i`` with head ``i + heads / 2`` (DiffLlama chunks the heads in
    two halves), one row per pair of the two heads' rows."""
    first, second = q.reshape(heads, -1).chunk(2)
    return torch.cat([first, second], dim=-1)


def test_heads_paired_across_halves_give_each_rank_whole_pairs() -> None:
    """The paired-heads layout stores each rank's block of each half, so the model's own pairing of the local
    heads gives that rank's block of the user's pairs; the contiguous block of heads (the negative control)
    pairs heads that are not partners."""
    from lightning_parallel.plans.attention import paired_heads_styles
    from lightning_parallel.plans.detect import ContainerCandidate

    heads, head_dim, ranks = 8, 2, 2

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(16, heads * head_dim)
            self.k_proj = torch.nn.Linear(16, 4 * head_dim)
            self.v_proj = torch.nn.Linear(16, 4 * head_dim)
            self.o_proj = torch.nn.Linear(heads * head_dim, 16)

    attention = Attention()
    candidate = ContainerCandidate("attn", attention, list(attention.named_children()))
    styles, kv_local = paired_heads_styles("attn", candidate, "o_proj", 16, heads, 4, head_dim, ranks)
    assert kv_local == 2
    layout = styles["attn.q_proj"].row_layout
    user = torch.arange(float(heads * head_dim))
    pairs = _paired(user, heads)
    for rank in range(ranks):
        mine = pairs[rank * heads // 2 // ranks : (rank + 1) * heads // 2 // ranks]
        assert torch.equal(_paired(layout.stored(user).chunk(ranks)[rank], heads // ranks), mine)
        assert not torch.equal(_paired(user.chunk(ranks)[rank], heads // ranks), mine)
    assert styles["attn.k_proj"].row_layout.index == (0, 1, 4, 5, 2, 3, 6, 7)
    assert paired_heads_styles("attn", candidate, "o_proj", 16, 6, 4, head_dim, ranks) is None  # 3 pairs
