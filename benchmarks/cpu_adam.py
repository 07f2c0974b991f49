"""DeepSpeed's CPU Adam on FSDP2's CPU shards against torch's AdamW on the same shards, side by side.

    python -m benchmarks.cpu_adam                    # 25M parameters, 10 rounds
    python -m benchmarks.cpu_adam --million 5 --rounds 4

What ``offload="cpu"`` on the FSDP2 engine (ZeRO-3 with tensor parallelism, ZeRO-2/3 with pipeline
or expert parallelism) steps: each rank's parameter shards, DTensors on the CPU, with their
gradients. One process (a one-rank gloo group, so the DTensors are real ones), the same shards and
gradients for both optimizers, the steps alternating (``ShardedCPUAdam``, then torch's ``AdamW``
with ``foreach``, then again), so a slow stretch of the machine hits both. Printed: the median
step time of each and the paired ratio torch / DeepSpeed (the speed-up the swap buys).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.common import machine, table


def _shards(million: int, seed: int) -> list[torch.nn.Parameter]:
    """Square fp32 weights of about ``million`` M elements, as one-rank DTensors with gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    generator = torch.Generator().manual_seed(seed)
    side, params = 1024, []
    for _ in range(max(1, million * 1_000_000 // (side * side))):
        weight = torch.nn.Parameter(
            distribute_tensor(torch.randn(side, side, generator=generator), mesh, [Shard(0)])
        )
        weight.grad = distribute_tensor(torch.randn(side, side, generator=generator) * 1e-3, mesh, [Shard(0)])
        params.append(weight)
    return params


def _time_step(optimizer: torch.optim.Optimizer) -> float:
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def measure(million: int, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    from lightning_parallel.zero.sharded_cpu_adam import ShardedCPUAdam

    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    deepspeed = ShardedCPUAdam(_shards(million, 0), adamw_mode=True, **hyper)
    torch_adamw = torch.optim.AdamW(_shards(million, 0), foreach=True, **hyper)
    times: dict[str, list[float]] = {"ShardedCPUAdam": [], "torch AdamW": []}
    for index in range(warmup + rounds):
        pair = (("ShardedCPUAdam", deepspeed), ("torch AdamW", torch_adamw))
        for name, optimizer in pair if index % 2 == 0 else pair[::-1]:
            elapsed = _time_step(optimizer)
            if index >= warmup:
                times[name].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--million", type=int, default=25, help="parameters, in millions")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(os.cpu_count() or 1)
    times = measure(args.million, args.rounds)
    dist.destroy_process_group()
    ratios = [t / d for t, d in zip(times["torch AdamW"], times["ShardedCPUAdam"], strict=True)]
    print(
        f"# {machine()}; {args.million}M fp32 parameters as DTensor shards on the CPU, {args.rounds} rounds\n"
    )
    print(table(["optimizer", "median step (ms)"],
                [[name, f"{1e3 * statistics.median(t):.1f}"] for name, t in times.items()]))  # fmt: skip
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(
        f"\ntorch AdamW / ShardedCPUAdam: {statistics.median(ratios):.2f}x (quartiles {q[0]:.2f}-{q[2]:.2f})"
    )


if __name__ == "__main__":
    main()
