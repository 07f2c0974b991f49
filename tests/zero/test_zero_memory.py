"""Bytes per rank under ZeRO 1/2/3 equal the theory (within 5%), on 2 and 4 data-parallel ranks.

fp32 with AdamW, Ψ trainable parameters, N data-parallel ranks (ZeRO paper, section 5):

| stage | module parameters | fp32 master | gradients | optimizer states (2 x fp32) |
|---|---|---|---|---|
| 1 | 4Ψ | 4Ψ/N | 4Ψ | 8Ψ/N |
| 2 | 4Ψ | 4Ψ/N | 4Ψ/N | 8Ψ/N |
| 3 | 4Ψ/N | 4Ψ/N | 2 x 4Ψ/N | 8Ψ/N |

Gradients are the peak over the end of backward and the optimizer step. At stage 3 DeepSpeed
holds the gradient partition twice while it steps: its partition buffer in the parameters'
precision (here fp32, in bf16 training 2Ψ/N) and the fp32 copy the optimizer updates from (the
ZeRO paper counts only the first); stages 1 and 2 step on the reduced buffer itself.

ZeRO-3 with tensor parallelism (4 ranks: tp=2 x dp=2, torch's FSDP2 over dp): each rank holds 1/dp
of what tensor parallelism alone would leave it, of parameters (the fp32 masters themselves),
gradients and the optimizer states; sharding over dp that did not engage would show twice that.
The same with ``offload="cpu"`` (the shards on the CPU, stepped by DeepSpeed's CPU Adam, whose
states are DTensors like them; on this CPU-only machine both sides are host memory), and with
``offload="nvme"`` (no optimizer state in memory: 8 bytes per element of the shard in files, padded
to whole 1 KiB blocks per file), and with ``offload_ratio=0.5`` (whole units offloaded, the nearest to
half of the elements, the rest stepped by torch's Adam on the device).

Measured on each rank through the real Trainer (tests/strategy/scripts/zero_memory.py). The 5%
leaves room for DeepSpeed's alignment padding of each partition, nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.strategy import launch

pytestmark = [pytest.mark.distributed]
SCRIPT = "zero_memory.py"
THEORY = {  # bytes per parameter, as (numerator, divided by N?)
    1: {"module_parameters": (4, False), "master_parameters": (4, True), "gradients": (4, False),
        "optimizer_states": (8, True)},
    2: {"module_parameters": (4, False), "master_parameters": (4, True), "gradients": (4, True),
        "optimizer_states": (8, True)},
    3: {"module_parameters": (4, True), "master_parameters": (4, True), "gradients": (8, True),
        "optimizer_states": (8, True)},
}  # fmt: skip


def _measure(tmp_path: Path, world_size: int) -> list[dict]:
    result = launch(SCRIPT, [str(tmp_path)], tmp_path, world_size=world_size, timeout_s=400, grace_s=30)
    result.assert_all_succeeded()
    return [json.loads((tmp_path / f"zero_memory.rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_per_rank_follow_the_zero_theory(tmp_path: Path, world_size: int) -> None:
    ranks = _measure(tmp_path, world_size)
    problems = []
    for rank, measured in enumerate(ranks):
        for stage, theory in THEORY.items():
            run = measured[f"zero{stage}"]
            assert run["world_size"] == world_size
            for kind, (per_param, sharded) in theory.items():
                expected = per_param * run["parameters"] / (world_size if sharded else 1)
                if abs(run[kind] - expected) > 0.05 * expected:
                    problems.append(
                        f"rank {rank} zero{stage} {kind}: {run[kind]} bytes, theory {expected:.0f}"
                    )
    if world_size == 4:  # ZeRO-3 with tensor parallelism (FSDP2): tp shards, sharded again over dp=2
        for measured in ranks:
            assert measured["zero3_tp2"]["optimizer"] == "AdamW"  # the user's, on the device
            # Offloaded: DeepSpeed's CPU Adam steps FSDP2's CPU shards, its states DTensors like them.
            assert measured["zero3_cpu_tp2"]["optimizer"] == "ShardedCPUAdam"
            assert measured["zero3_cpu_tp2"]["sharded_states"]
            # NVMe: the same kernel, Adam's states in files between steps (none in host memory), each file
            # the shard's states padded to whole 1 KiB blocks; every step wrote them all.
            nvme = measured["zero3_nvme_tp2"]
            assert nvme["optimizer"] == "ShardedNVMeAdam"
            assert nvme["optimizer_states"] == 0
            theory = 8 * nvme["tensor_parallel_numel"] / 2
            assert nvme["nvme_disk_bytes"] == nvme["nvme_padded_bytes"] >= theory
            assert nvme["nvme_written_bytes"] == nvme["nvme_padded_bytes"]  # one step, each state once
            # Partial offload (offload_ratio=0.5): whole units offloaded, their elements the nearest to half
            # (within half the largest unit), each unit's FSDP2 policy agreeing with how its parameters step;
            # with the whole optimizer offloaded (ratio 1) nothing is kept on the device.
            half, full = measured["zero3_cpu_tp2_half"], measured["zero3_cpu_tp2"]
            assert half["units"] > 2 and half["policies_agree"] and full["policies_agree"]
            assert 0 < half["kept_fraction"] < 1 and full["kept_fraction"] == 0
            assert abs((1 - half["kept_fraction"]) - 0.5) <= half["largest_unit_fraction"] / 2 + 1e-9
        runs = [
            (rank, name, measured[name])
            for rank, measured in enumerate(ranks)
            for name in ("zero3_tp2", "zero3_cpu_tp2", "zero3_nvme_tp2", "zero3_cpu_tp2_half")
        ]
        for rank, name, run in runs:
            per_rank = run["tensor_parallel_numel"] / 2  # what tp alone leaves a rank, over dp=2
            # Tensor parallelism engaged (the ratio is 1.0 if not).
            assert run["tensor_parallel_numel"] < 0.75 * run["parameters"]
            kinds = (
                ("module_parameters", 4),
                ("gradients", 4),
                ("optimizer_states", 0 if "nvme" in name else 8),
            )
            for kind, per_param in kinds:
                expected = per_param * per_rank
                if abs(run[kind] - expected) > 0.05 * expected:
                    problems.append(f"rank {rank} {name} {kind}: {run[kind]} bytes, theory {expected:.0f}")
        # ZeRO-2/3 on FSDP2 under two pipeline stages (dp=2): Ψ_s the stage's parameters. ZeRO-2 keeps the
        # gathered whole parameters between steps (4Ψ_s) beside its fp32 master shard (4Ψ_s/2); ZeRO-3's
        # module parameters are the master shards themselves.
        pipelined = {2: {"module_parameters": (4, False), "master_parameters": (4, True), "gradients": (4, True),
                         "optimizer_states": (8, True)},
                     3: {"module_parameters": (4, True), "master_parameters": (0, True), "gradients": (4, True),
                         "optimizer_states": (8, True)}}  # fmt: skip
        for rank, measured in enumerate(ranks):
            for stage, theory in pipelined.items():
                run = measured[f"zero{stage}_pp2"]
                for kind, (per_param, sharded) in theory.items():
                    expected = per_param * run["stage_parameters"] / (2 if sharded else 1)
                    if abs(run[kind] - expected) > 0.05 * expected + (1 if expected == 0 else 0):
                        problems.append(
                            f"rank {rank} zero{stage}_pp2 {kind}: {run[kind]} bytes, theory {expected:.0f}"
                        )
        # ZeRO-3 with expert parallelism (ep=2 x dp_replicate=2): dense weights over all 4 ranks, each ep
        # slice (half the experts) over its 2 replicas: a rank holds a quarter of both.
        for rank, measured in enumerate(ranks):
            run = measured["zero3_ep2"]
            assert 0 < run["expert_parameters"] < run["parameters"]
            expected_experts = 4 * run["expert_parameters"] / 4
            if abs(run["expert_bytes"] - expected_experts) > 0.05 * expected_experts:
                problems.append(
                    f"rank {rank} zero3_ep2 experts: {run['expert_bytes']} bytes, theory {expected_experts:.0f}"
                )
            for kind, per_param in (("module_parameters", 4), ("gradients", 4), ("optimizer_states", 8)):
                expected = per_param * run["parameters"] / 4
                if abs(run[kind] - expected) > 0.05 * expected:
                    problems.append(f"rank {rank} zero3_ep2 {kind}: {run[kind]} bytes, theory {expected:.0f}")
    assert not problems, "\n".join(problems)
