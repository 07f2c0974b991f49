"""The time model: the published tables within their targets, controls showing its terms matter, unit checks.

No processes: every test is arithmetic on shapes, layouts and cluster presets (well under a second).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lightning_parallel.pipeline.schedules import SCHEDULES, ideal_efficiency
from lightning_parallel.planner import published
from lightning_parallel.planner.cluster import CLUSTERS, load_cluster
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.micro_batch import _gemm_elements, all_to_all_time, group_bandwidth, half_ring
from lightning_parallel.planner.shapes import ModelShape
from lightning_parallel.planner.timing import STRATEGY, step_time

TABLES = {"ptd-p": published.PTD_P, "megatron-h100": published.MEGATRON_H100}
GPT_1_3B = ModelShape.gpt(24, 2048, 16, 50304, sequence_length=2048)


def _misses(mae: float, worst: float) -> bool:
    return mae > 0.10 or worst > 0.20


@pytest.mark.parametrize("table", TABLES)
def test_published_table_within_targets(table: str) -> None:
    """One efficiency per chip for the whole table: mean absolute error <= 10%, no row off by more than 20%."""
    comparisons = published.compare(TABLES[table])
    mae, worst = published.summary(comparisons)
    assert mae <= 0.10 and worst <= 0.20, published.markdown(comparisons)


def test_control_ptdp_without_communication_or_bubble_misses() -> None:
    """Leaving out the tensor-parallel collectives, the bubble and the gradient all-reduce breaks PTD-P's targets."""
    comparisons = published.compare(published.PTD_P)
    errors = [abs(c.without("tensor_parallel", "pipeline_bubble", "data_parallel") / c.run.tflops - 1)
              for c in comparisons]  # fmt: skip
    assert _misses(sum(errors) / len(errors), max(errors))
    alone = [abs(c.without("tensor_parallel") / c.run.tflops - 1) for c in comparisons]
    assert max(alone) > 0.15  # the 18B row (tp=8, no pipeline) spends 15% of its step in all-reduces


def test_control_ptdp_without_memory_traffic_misses_at_every_efficiency() -> None:
    """Without the HBM term (what makes small widths slower), no single matmul efficiency fits PTD-P."""
    a100 = CLUSTERS["a100-80gb"]
    for percent in range(40, 101, 2):
        cluster = replace(a100, matmul_efficiency=percent / 100, memory_bandwidth=1e18)
        assert _misses(*published.summary(published.compare(published.PTD_P, cluster))), percent


def test_control_megatron_without_its_overlap_misses() -> None:
    """Megatron's rows need its overlapped collectives: run in line (the strategy's way) the tp=8 rows fall short."""
    comparisons = published.compare(published.MEGATRON_H100, execution=STRATEGY)
    assert _misses(*published.summary(comparisons))
    assert all(c.error < -0.10 for c in comparisons if c.run.tensor == 8)


def test_megatron_strong_scaling_of_177b() -> None:
    """The README's other figure: 177B on 96 GPUs at 47% MFU, on 2304 at 44% (ratio 0.915-0.957 after rounding)."""
    run = next(r for r in published.MEGATRON_H100 if r.name == "177B")
    mfu = [published.compare((replace(run, gpus=gpus, batch=1152),))[0].step.mfu for gpus in (96, 2304)]
    assert 0.915 <= mfu[1] / mfu[0] <= 0.957
    assert mfu[0] == pytest.approx(0.47, abs=0.03)


def test_megatron_convention_is_the_model_convention() -> None:
    """Megatron's 2024 count, 12 B s L h^2 (6 + s/h + V/2Lh), is 3 x ModelShape's forward FLOPs."""
    run = published.MEGATRON_H100[0]
    shape = ModelShape.gpt(run.layers, run.hidden, run.heads, 131_072, sequence_length=4096, tied_head=False)
    model = 3 * shape.forward_flops_per_token(4096) * run.batch * 4096
    assert published.published_flops(run) == pytest.approx(model, rel=1e-12)


def test_h200_anchors() -> None:
    """Measured on the lent H200 (ANCHORS.md): eager, full recomputation, ZeRO-2 CPU offload, GPT-2 124M."""
    h200 = CLUSTERS["h200"]
    batch = {"precision": "bf16-mixed", "micro_batch_size": 8, "sequence_length": 2048}
    cases = [
        (GPT_1_3B, Layout(**batch), 0.2827),
        (GPT_1_3B, Layout(**batch, activation_checkpointing="full"), 0.3452),
        (GPT_1_3B, Layout(**batch, zero_stage=2, offload="cpu"), 0.9088),
        (ModelShape.gpt(12, 768, 12, 50304, sequence_length=1024),
         Layout(precision="bf16-mixed", micro_batch_size=32, sequence_length=1024), 0.0845),
    ]  # fmt: skip
    for shape, layout, measured in cases:
        assert step_time(shape, layout, h200).total == pytest.approx(measured, rel=0.10), layout.short()


# ---- units ---------------------------------------------------------------------------------------


def _pipeline(**overrides) -> Layout:
    base = {"pipeline_parallel": 4, "micro_batches": 8, "micro_batch_size": 2, "sequence_length": 2048,
            "precision": "bf16-mixed"}  # fmt: skip
    return Layout(**{**base, **overrides})


def test_doubling_data_parallel_halves_compute_per_rank_at_fixed_global_batch() -> None:
    shape = ModelShape.gpt(16, 2048, 16, 50304)
    one = step_time(shape, _pipeline(data_parallel=2, micro_batches=16), CLUSTERS["h100"])
    two = step_time(shape, _pipeline(data_parallel=4, micro_batches=8), CLUSTERS["h100"])
    assert one.tokens == two.tokens
    assert two.compute == pytest.approx(one.compute / 2)
    assert two.model_flops == pytest.approx(one.model_flops)


@pytest.mark.parametrize(
    ("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbv", 2)]
)
def test_bubble_fraction_is_the_schedules_ideal_efficiency(schedule: str, virtual: int) -> None:
    layout = _pipeline(pipeline_schedule=schedule, pipeline_virtual_stages=virtual)
    step = step_time(ModelShape.gpt(16, 1024, 16, 50304), layout, CLUSTERS["a100-80gb"])
    pipeline = step.compute + step.tensor_parallel + step.pipeline_transfers + step.pipeline_bubble
    expected = 1 - ideal_efficiency(SCHEDULES[schedule], 8, 4, virtual)
    assert step.pipeline_bubble / pipeline == pytest.approx(expected)


def test_mfu_and_hardware_flops() -> None:
    cluster = CLUSTERS["h100"]
    plain = step_time(
        GPT_1_3B, Layout(precision="bf16-mixed", micro_batch_size=8, sequence_length=2048), cluster
    )
    assert plain.mfu == pytest.approx(plain.model_flops / (plain.total * 1 * cluster.peak_bf16_flops))
    assert plain.hardware_flops == plain.model_flops and plain.recomputation == 0
    full = step_time(GPT_1_3B, Layout(precision="bf16-mixed", micro_batch_size=8, sequence_length=2048,
                                      activation_checkpointing="full"), cluster)  # fmt: skip
    assert full.total > plain.total and full.recomputation > 0
    assert (
        1.25 < full.hardware_flops / full.model_flops < 4 / 3
    )  # one more forward of the blocks, not the head
    selective = step_time(GPT_1_3B, Layout(precision="bf16-mixed", micro_batch_size=8, sequence_length=2048,
                                           activation_checkpointing="selective"), cluster)  # fmt: skip
    assert plain.total < selective.total < full.total  # reruns the cheap ops only


def test_tensor_parallel_beyond_a_node_uses_the_network() -> None:
    h100 = CLUSTERS["h100"]
    assert group_bandwidth(h100, 8, 1) == pytest.approx(450e9 * 0.8)
    assert group_bandwidth(h100, 16, 1) == pytest.approx(8 * 50e9 * 0.85)  # eight NICs a node carry the rings
    assert group_bandwidth(h100, 4, 8) == pytest.approx(50e9 * 0.85)  # one member a node: one NIC
    shape = ModelShape.gpt(8, 8192, 64, 51200)
    inside, across = (
        step_time(shape, Layout(tensor_parallel=tp, precision="bf16-mixed", sequence_length=2048), h100)
        for tp in (8, 16)
    )
    assert across.tensor_parallel > inside.tensor_parallel


def test_an_all_to_all_across_nodes_waits_on_each_ranks_own_nic() -> None:
    h100 = CLUSTERS["h100"]
    gib = 2.0**30
    assert all_to_all_time(gib, 8, 1, h100) == pytest.approx(
        half_ring(gib, 8, group_bandwidth(h100, 8, 1))
    )  # in a node
    # two nodes: half of the buffer leaves the node, through this GPU's NIC alone (a ring would use all eight)
    assert all_to_all_time(gib, 16, 1, h100) == pytest.approx(0.5 * gib / (50e9 * 0.85))
    assert all_to_all_time(gib, 16, 1, h100) > 4 * half_ring(gib, 16, group_bandwidth(h100, 16, 1))
    moe = ModelShape.gpt(8, 1024, 16, 50304, num_experts=16, top_k=2)
    base = {"data_parallel": 16, "precision": "bf16-mixed", "micro_batch_size": 4, "sequence_length": 2048}
    inside, across = (step_time(moe, Layout(**base, expert_parallel=ep), h100) for ep in (8, 16))
    assert across.expert_all_to_all > 4 * inside.expert_all_to_all


def test_zero_stages_experts_and_offload() -> None:
    cluster = CLUSTERS["h100"]
    base = {"data_parallel": 16, "precision": "bf16-mixed", "micro_batch_size": 4, "sequence_length": 2048}
    steps = {z: step_time(GPT_1_3B, Layout(**base, zero_stage=z), cluster) for z in (0, 1, 3)}
    assert steps[1].optimizer == pytest.approx(steps[0].optimizer / 16)  # 1/dp of the states a rank
    assert steps[3].data_parallel < steps[1].data_parallel  # FSDP2 prefetches, DeepSpeed gathers after
    slow = replace(cluster, inter_node_bandwidth=1e9)  # gathers far longer than compute: nothing hides them
    zero1, zero3 = (step_time(GPT_1_3B, Layout(**base, zero_stage=z), slow) for z in (1, 3))
    assert zero3.data_parallel > 1.3 * zero1.data_parallel  # 3 passes over the parameters instead of 2
    offload = step_time(GPT_1_3B, Layout(**base, zero_stage=2, offload="cpu"), cluster)
    assert offload.optimizer > steps[1].optimizer
    moe = ModelShape.gpt(8, 1024, 16, 50304, num_experts=8, top_k=2)
    dense = step_time(moe, Layout(**base), cluster)
    sharded = step_time(moe, Layout(**base, expert_parallel=8), cluster)
    assert dense.expert_all_to_all == 0 < sharded.expert_all_to_all


# ---- clusters ------------------------------------------------------------------------------------


def test_presets_and_yaml(tmp_path: Path) -> None:
    assert set(CLUSTERS) == {"a100-40gb", "a100-80gb", "h100", "h100-hbm2e-500w", "h200", "b200", "gb200"}
    variant = CLUSTERS["h100-hbm2e-500w"]  # torchtitan's H100s: slower memory, a peak between SXM's and NVL's
    assert variant.memory_bandwidth < CLUSTERS["h100"].memory_bandwidth
    assert 835e12 < variant.peak_bf16_flops < CLUSTERS["h100"].peak_bf16_flops
    assert load_cluster("H100") is CLUSTERS["h100"]
    assert CLUSTERS["a100-40gb"].peak_fp8_flops == 0 and CLUSTERS["b200"].peak_bf16_flops == 2.25e15
    full = tmp_path / "mine.yaml"
    fields = {k: v for k, v in vars(CLUSTERS["h100"]).items() if k not in ("name", "source")}
    full.write_text("name: mine\n" + "".join(f"{k}: {v!r}\n" for k, v in fields.items()))
    assert load_cluster(full) == replace(CLUSTERS["h100"], name="mine", source="")
    based = tmp_path / "slow-net.yaml"
    based.write_text("base: h100\ninter_node_bandwidth: 12.5e9\n")  # YAML reads 12.5e9 as a string
    assert load_cluster(based).inter_node_bandwidth == 12.5e9 and load_cluster(based).name == "slow-net"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("base: h100\nnvlink_bandwidth: 1\n", "nvlink_bandwidth"),
        ("base: h1000\n", "h1000"),
        ("name: x\npeak_bf16_flops: 1e15\n", "missing key"),
        ("base: h100\nmatmul_efficiency: 1.5\n", "matmul_efficiency"),
    ],
)
def test_bad_cluster_yaml(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_cluster(path)


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ValueError, match=r"h1000.*a100-40gb.*a100-80gb.*b200.*h100.*h200"):
        load_cluster("h1000")


def test_the_overlapped_host_step_hides_behind_backward_on_fsdp2() -> None:
    """ZeRO-2 CPU offload of GPT-1.3B on one H200: DeepSpeed's engine steps after backward (the measured 0.91 s
    above); FSDP2's host step overlaps the last backward and the next forward, where the strategy does it."""
    h200 = CLUSTERS["h200"]
    batch = {"precision": "bf16-mixed", "micro_batch_size": 8, "sequence_length": 2048, "zero_stage": 2}
    deepspeed = step_time(GPT_1_3B, Layout(**batch, offload="cpu", zero_engine="deepspeed"), h200)
    fsdp2 = step_time(GPT_1_3B, Layout(**batch, offload="cpu", zero_engine="fsdp2"), h200)
    waiting = step_time(GPT_1_3B, Layout(**batch, offload="cpu", zero_engine="fsdp2"), h200,
                        replace(STRATEGY, overlap_host_step=False))  # fmt: skip
    eager = step_time(
        GPT_1_3B, Layout(precision="bf16-mixed", micro_batch_size=8, sequence_length=2048), h200
    )
    assert fsdp2.optimizer < waiting.optimizer == pytest.approx(deepspeed.optimizer)
    # Never below one unit's share: the last unit's host step has no backward left to hide behind.
    assert fsdp2.optimizer >= waiting.optimizer / len(GPT_1_3B.blocks)
    assert eager.total < fsdp2.total < deepspeed.total  # docs/zero.md prints the three
    delayed = step_time(GPT_1_3B, Layout(**batch, offload="cpu", offload_update="delayed"), h200)
    assert delayed.optimizer == pytest.approx(
        max(0.0, waiting.optimizer - fsdp2.compute)
    )  # behind the next step
    fast_host = replace(
        h200, host_adam_throughput=8 * h200.host_adam_throughput, host_bandwidth=4 * h200.host_bandwidth
    )
    hidden = step_time(GPT_1_3B, Layout(**batch, offload="cpu", offload_update="delayed"), fast_host)
    assert hidden.optimizer == 0.0 < step_time(GPT_1_3B, Layout(**batch, offload="cpu", zero_engine="fsdp2"),
                                                fast_host).optimizer  # fmt: skip
    # ZeRO-3 keeps the parameters on the host: each pass copies them up a block ahead, behind the compute.
    zero3 = step_time(
        GPT_1_3B, Layout(**{**batch, "zero_stage": 3}, offload="cpu", zero_engine="fsdp2"), h200
    )
    up = GPT_1_3B.parameters * 4 / (h200.host_bandwidth * h200.host_efficiency)  # fp32 shards, once per pass
    copies = zero3.optimizer - fsdp2.optimizer  # what of the two passes' copies is exposed
    assert (
        2 * up / len(GPT_1_3B.blocks) <= copies < 0.25 * (2 * up)
    )  # the first block's, and what passes overrun
    nvme = step_time(GPT_1_3B, Layout(**batch, offload="nvme", zero_engine="fsdp2"), h200)
    assert nvme.optimizer > waiting.optimizer  # the NVMe path waits for backward (its states come from files)


def test_the_importance_split_waits_only_for_the_chosen_rows() -> None:
    """ZeRO-2 CPU offload of GPT-1.3B on one H200 with an importance split (``zero/importance_split.py``): the step
    waits for the chosen rows' Adam; the others' sums and update hide behind the next step's passes, on a host
    fast enough; on a slow host the excess shows, and more of it the fewer steps between two updates."""
    from lightning_parallel import ImportanceSplit
    from lightning_parallel.planner.timing import split_host_time

    h200 = CLUSTERS["h200"]
    batch = {"precision": "bf16-mixed", "micro_batch_size": 8, "sequence_length": 2048, "zero_stage": 2}
    exact = step_time(GPT_1_3B, Layout(**batch, offload="cpu", zero_engine="fsdp2"), h200)
    split = step_time(GPT_1_3B, Layout(**batch, offload="cpu", offload_update=ImportanceSplit()), h200)
    adam = GPT_1_3B.parameters / h200.host_adam_throughput
    assert split.optimizer < exact.optimizer
    assert split_host_time(ImportanceSplit(), adam, passes=10 * adam) == pytest.approx(
        0.05 * adam
    )  # all hidden
    slow = [split_host_time(ImportanceSplit(update_interval=n), adam, passes=0.2 * adam) for n in (1, 4)]
    assert slow[0] > slow[1] > 0.05 * adam
    assert slow[0] == pytest.approx(0.05 * adam + 0.95 * adam * (1 + 3 / 7) - 0.2 * adam)


def test_a_rank_reads_the_weights_of_its_own_experts_once_per_pass() -> None:
    """Under expert parallelism a rank holds ``experts / ep`` experts, each multiplying the tokens its dispatch
    gathers from the ``ep`` ranks: the expert weights it reads per token fall ``ep``-fold (the other terms stay)."""
    moe = ModelShape.gpt(8, 1024, 16, 50304, num_experts=16, top_k=2)
    block = moe.blocks[0]
    base = {"data_parallel": 8, "precision": "bf16-mixed", "micro_batch_size": 1, "sequence_length": 512}
    alone, spread = (_gemm_elements(block, Layout(**base, expert_parallel=ep)) for ep in (1, 8))
    up = block.ffn_hidden * (2 if block.gated else 1)
    expert_weights = block.num_experts * (block.hidden * up + block.ffn_hidden * block.hidden)
    tokens = Layout(**base).local_tokens
    assert alone - spread == pytest.approx(expert_weights / tokens * (1 - 1 / 8))
    dense = ModelShape.gpt(8, 1024, 16, 50304).blocks[0]  # control: no experts, ep changes nothing
    assert _gemm_elements(dense, Layout(**base, expert_parallel=8)) == _gemm_elements(dense, Layout(**base))


def test_a_rank_casts_the_weights_it_holds_to_fp8_its_own_experts_only() -> None:
    """fp8 casts each weight a rank holds once per micro-batch: every expert without expert parallelism, its
    ``experts / ep`` with it (a token's top-k is what it multiplies with, not what the rank casts)."""
    moe = ModelShape.gpt(8, 1024, 16, 50304, num_experts=16, top_k=2).blocks[0]
    expert = 2 * moe.hidden * moe.ffn_hidden  # GELU MLP: up and down
    assert moe.matmul_weights_held(1) - moe.matmul_weights_held(8) == pytest.approx(expert * (16 - 2))
    assert moe.matmul_weights_held(16) == pytest.approx(moe.matmul_weights_per_token - expert)  # one vs top-2
    dense = ModelShape.gpt(8, 1024, 16, 50304).blocks[0]  # control: no experts, ep changes nothing
    assert dense.matmul_weights_held(8) == dense.matmul_weights_per_token


def test_compute_gathers_halve_zero3s_gathers_and_the_gathered_copies() -> None:
    """``zero_gather_dtype="compute"``: FSDP2's all-gathers and unsharded copies in 16 bits (2 bytes, not the fp32
    shards' 4) where gathers are all that is exposed; the shards, gradients and states the rank keeps are alike."""
    from lightning_parallel.planner.layout import gathered_parameter_bytes
    from lightning_parallel.planner.memory import rank_memory
    from recipes.gpt.module import GPTLightningModule

    slow = replace(CLUSTERS["h100"], inter_node_bandwidth=1e9)
    base = {"data_parallel": 16, "precision": "bf16-mixed", "micro_batch_size": 4, "sequence_length": 2048}
    stored, compute = (
        step_time(GPT_1_3B, Layout(**base, zero_stage=3, zero_gather_dtype=gathers), slow)
        for gathers in ("stored", "compute")
    )
    assert compute.data_parallel < 0.8 * stored.data_parallel
    assert gathered_parameter_bytes(Layout(zero_stage=3, zero_gather_dtype="compute")) == 2
    assert gathered_parameter_bytes(Layout(zero_stage=3)) is None  # DeepSpeed's engine, fp32 gathers
    model = GPTLightningModule(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
    small = {"data_parallel": 2, "precision": "bf16-mixed", "micro_batch_size": 2, "sequence_length": 16}
    (kept,), (halved,) = (
        rank_memory(model, Layout(**small, zero_stage=3, zero_engine="fsdp2", zero_gather_dtype=gathers))
        for gathers in ("stored", "compute")
    )
    assert halved.buffers * 2 == kept.buffers > 0
    assert (halved.parameters, halved.gradients, halved.optimizer) == (
        kept.parameters,
        kept.gradients,
        kept.optimizer,
    )
