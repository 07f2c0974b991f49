"""The largest GPT one GPU trains with ZeRO-3 and CPU offload (parameters, gradients, optimizer on the host).

    PYTHONPATH=. python -m benchmarks.zero_offload                       # the ladder, each size in a fresh process
    PYTHONPATH=. python -m benchmarks.zero_offload --sizes 2.7B,6.7B     # only these sizes
    PYTHONPATH=. python -m benchmarks.zero_offload --tiny --cpu          # the same code path on a CPU

``zero_stage=3, offload="cpu"``, bf16-mixed, full activation checkpointing, batch 1 x 2048, three
steps per size, each size in a fresh subprocess (a failed allocation must not poison the next), from
the largest whose host state fits down; prints the largest that trained (target: at least 8B
parameters). The host bounds it: with fp32 parameters (bf16-mixed), DeepSpeed keeps about 20 bytes
per parameter in host memory (the parameter, its fp32 master, its gradient, Adam's two states), so
128 GB of host memory holds about 6B parameters; sizes that would need more than 110% of the host's
memory are reported, not tried. The step-time cost of offloading against plain eager is
``benchmarks/zero_engines.py --group offload``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import torch

from benchmarks.common import machine, quiet_lightning
from benchmarks.gpu_step import LARGE, TINY, _batches, _module_params
from benchmarks.zero_engines import run_strategy

HOST_BYTES_PER_PARAMETER = 20  # fp32 parameter + fp32 master + fp32 gradient + Adam's two fp32 states
# GPT shapes for the ladder (n_layer, n_head, n_embd): GPT-3 paper widths; 8.3B is Megatron-LM's (72 x 3072; the
# ladder had 40 heads of a 4096 width, which the recipe refuses: every 8.3B attempt failed at construction).
LADDER = {
    "2.7B": (32, 32, 2560), "6.7B": (32, 32, 4096), "8.3B": (72, 32, 3072), "13B": (40, 40, 5120),
    "20B": (44, 48, 6144),
}  # fmt: skip


def host_bytes() -> int | None:
    """This machine's memory (``MemTotal`` of ``/proc/meminfo``), None where it cannot be read."""
    try:
        for line in open("/proc/meminfo").read().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def parameters_of(name: str) -> int:
    layers, heads, width = LADDER[name]
    return _module_params(dict(LARGE, n_layer=layers, n_head=heads, n_embd=width))


def fitting_first(sizes: list[str], host: int | None) -> tuple[list[str], dict[str, str]]:
    """The sizes whose host state (``HOST_BYTES_PER_PARAMETER``, an estimate) is within 110% of the host's memory,
    largest first (the first that trains is the answer: climbing from the smallest spent the check's time on
    sizes that could not be it), and why the others are not tried."""
    skipped = {}
    fitting = []
    for name in sorted(sizes, key=parameters_of, reverse=True):
        needed = parameters_of(name) * HOST_BYTES_PER_PARAMETER
        if host is not None and needed > 1.1 * host:
            skipped[name] = (
                f"not tried: needs about {needed / 2**30:.0f} GiB of host memory, the host has {host / 2**30:.0f}"
            )
        else:
            fitting.append(name)
    return fitting, skipped


def largest(sizes: list[str], cpu: bool, limit_s: float) -> dict[str, Any]:
    trained, tried = None, {}
    if sizes != ["tiny"]:
        sizes, tried = fitting_first(sizes, host_bytes())
        for name, why in tried.items():
            print(f"{name}: {why}", flush=True)
    for name in sizes:
        command = [sys.executable, "-m", "benchmarks.zero_offload", "--one", name] + (
            ["--cpu"] if cpu else []
        )
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s)
            ok = done.returncode == 0 and "TRAINED" in done.stdout
            tried[name] = "trained" if ok else (done.stderr.strip().splitlines() or ["failed"])[-1][:300]
        except subprocess.TimeoutExpired:
            ok, tried[name] = False, f"not done in {limit_s:.0f} s"
        print(f"{name}: {tried[name]}", flush=True)
        if ok:
            trained = name
            break  # largest first: the first that trains is the largest
    print(f"RESULT largest GPT trained with ZeRO-3 + CPU offload: {trained} (target: >= 8B)")
    return {"largest": trained, "tried": tried, "host_bytes_per_parameter": HOST_BYTES_PER_PARAMETER}


def one(name: str, device: torch.device) -> None:
    if name == "tiny":
        shape = dict(TINY, batch_size=1)
    else:
        layers, heads, width = LADDER[name]
        shape = dict(LARGE, n_layer=layers, n_head=heads, n_embd=width, batch_size=1)
    result = run_strategy(shape, _batches(shape, 3), device, 1, 2, zero_stage=3, offload="cpu",
                          activation_checkpointing="full")  # fmt: skip
    print(f"TRAINED {name}: {_module_params(shape) / 1e9:.2f}B parameters, peak {result['peak_gib']:.1f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model: check the code path")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny)")
    parser.add_argument("--sizes", default=",".join(LADDER), help="comma-separated sizes of the ladder")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--limit-s", type=float, default=300.0, help="per size")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    quiet_lightning()
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.one:
        one(args.one, device)
        return
    print(machine())
    result = largest(["tiny"] if args.tiny else args.sizes.split(","), args.cpu, args.limit_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
