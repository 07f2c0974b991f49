"""Mixture-of-Experts: all-to-all volume under expert parallelism, and MoE vs dense step time.

    python -m benchmarks.moe                 # both parts, the "small" shape
    python -m benchmarks.moe --part volume   # only the all-to-all bytes (2 CPU processes over gloo)
    python -m benchmarks.moe --part time --steps 30 --shape tiny

**Volume** (2 ranks, ``ExpertParallel.apply(model, world, token_group=world)``, experts sharded
2 ways): every ``all_to_all_single`` of one training step (forward and backward) of the recipe
GPT-MoE is recorded on each rank (``torch.distributed.all_to_all_single`` wrapped for the run),
split into the token payloads and the exchange of per-expert counts, and summed over the ranks.
Theoretical volume of the payloads, per MoE layer and direction: ``tokens x hidden x k x 2``
elements (the dispatch and the combine each move every (token, choice) row once; tokens of
all ranks). Target: equal when dropless; with a capacity factor, dropped rows are not sent, so
less. (One rank alone is not the theory: it sends its own rows in the dispatch but the rows its
experts received in the combine.) Rows a rank sends to its own experts stay in memory (gloo
copies them); "off-rank" excludes them.

**Time** (1 process, 1 thread): the recipe GPT-MoE against a dense GPT with the same active
parameters per token (the same attention; each dense MLP ``top_k`` times as wide as one expert,
i.e. the two experts a token uses side by side), same batches, AdamW. Steps alternate MoE,
dense, MoE, ... so load from elsewhere hits both; the ratio is the median of the back-to-back
pairs' ratios (quartiles printed). The MoE does the same matmul FLOPs per token plus routing,
sorting and gathering: the ratio is the price of sparsity on this hardware.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

SHAPES = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8, num_experts=4, top_k=2),
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=8, num_experts=8, top_k=2),
}
VOCAB = 320


def _moe_model(shape: dict[str, Any], capacity_factor: float | None, seed: int = 1234) -> nn.Module:
    from recipes.moe.model import MoEGPT, MoEGPTConfig

    torch.manual_seed(seed)
    config = {k: v for k, v in shape.items() if k != "batch_size"}
    return MoEGPT(MoEGPTConfig(vocab_size=VOCAB, capacity_factor=capacity_factor, **config))


def _batch(shape: dict[str, Any], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(256, (shape["batch_size"], shape["block_size"] + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


# ---- volume ---------------------------------------------------------------------------------------


def _record_all_to_all(events: list[dict[str, Any]]) -> Any:
    """Wrap ``torch.distributed.all_to_all_single``: every call appended to ``events``; returns the original."""
    import torch.distributed as dist

    original = dist.all_to_all_single

    def recorded(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        rank = dist.get_rank(group)
        splits = input_split_sizes or [input.shape[0] // dist.get_world_size(group)] * dist.get_world_size(
            group
        )
        width = input.numel() // input.shape[0] if input.shape[0] else 0
        events.append({"dtype": str(input.dtype), "rows": int(input.shape[0]),
                       "bytes": int(input.numel() * input.element_size()),
                       "to_self_bytes": int(splits[rank] * width * input.element_size())})  # fmt: skip
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = recorded
    return original


def _volume_worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from benchmarks.common import init_process_group, write_json
    from lightning_parallel.experts import ExpertParallel, moe_aux_loss, moe_layers

    torch.set_num_threads(1)
    rank = init_process_group()
    shape = SHAPES[args.shape]
    results = {}
    for label, capacity in (("dropless", None), ("capacity_factor=1.0", 1.0)):
        model = _moe_model(shape, capacity)
        ExpertParallel.apply(model, dist.group.WORLD, token_group=dist.group.WORLD)
        x, y = _batch(shape, seed=rank)
        events: list[dict[str, Any]] = []
        original = _record_all_to_all(events)
        try:
            logits = model(x)
            forward_events = len(events)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1)) + moe_aux_loss(model)
            loss.backward()
        finally:
            dist.all_to_all_single = original
        layers = moe_layers(model)
        results[label] = {
            "forward": events[:forward_events], "backward": events[forward_events:], "layers": len(layers),
            "tokens": x.numel(), "hidden": shape["n_embd"], "top_k": shape["top_k"], "num_experts": shape["num_experts"],
            "dropped": [float(m.dropped_fraction) for m in layers],
        }  # fmt: skip
    write_json(args.out / f"volume.rank{rank}.json", results)


def _summarize_volume(ranks: list[dict[str, Any]]) -> None:
    """Both ranks' all-to-alls together against the theory for both ranks' tokens."""
    world = len(ranks)
    for label, r in ranks[0].items():
        r = dict(r)
        for direction in ("forward", "backward"):
            r[direction] = [e for other in ranks for e in other[label][direction]]
        theory = world * r["tokens"] * r["hidden"] * r["top_k"] * 2 * 4  # fp32 bytes per layer and direction
        print(f"\n{label}: {r['layers']} MoE layers, {r['tokens']} tokens/rank, hidden {r['hidden']}, "
              f"top-{r['top_k']} of {r['num_experts']} experts over {world} ranks; dropped per layer "
              + ", ".join(f"{d:.3f}" for d in r["dropped"]))  # fmt: skip
        rows = []
        for direction in ("forward", "backward"):
            events = r[direction]
            payload = [e for e in events if e["dtype"].startswith("torch.float") or "bfloat" in e["dtype"]]
            counts = [e for e in events if e not in payload]
            per_layer = sum(e["bytes"] for e in payload) / r["layers"]
            to_self = sum(e["to_self_bytes"] for e in payload) / r["layers"]
            rows.append([direction, len(payload), f"{per_layer:,.0f}", f"{theory:,.0f}", f"{per_layer / theory:.3f}",
                         f"{per_layer - to_self:,.0f}", f"{len(counts)} x {counts[0]['bytes'] if counts else 0} B"])  # fmt: skip
        from benchmarks.common import table

        print(table(["pass (all ranks)", "payload all-to-alls", "payload B/layer", "theory B/layer", "ratio",
                     "off-rank B/layer", "count exchanges"], rows))  # fmt: skip


# ---- time -----------------------------------------------------------------------------------------


class _DenseMLP(nn.Module):
    """GPT-2 MLP ``top_k`` times as wide as one expert: the active parameters of the MoE MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.nn.functional.gelu(self.fc(x)))


def _dense_model(shape: dict[str, Any]) -> nn.Module:
    from recipes.gpt.model import GPT, GPTConfig

    torch.manual_seed(1234)
    config = {k: v for k, v in shape.items() if k in ("n_layer", "n_head", "n_embd", "block_size")}
    model = GPT(GPTConfig(vocab_size=VOCAB, **config))
    for block in model.transformer.h:
        block.mlp = _DenseMLP(shape["n_embd"], shape["top_k"] * 4 * shape["n_embd"])
    return model


def _time(args: argparse.Namespace) -> None:
    import torch.nn.functional as F

    from lightning_parallel.experts import moe_aux_loss

    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    models = {"moe": _moe_model(shape, args.capacity_factor), "dense": _dense_model(shape)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for step in range(args.warmup + args.steps):
        x, y = _batch(shape, seed=step)
        order = ("moe", "dense") if step % 2 == 0 else ("dense", "moe")
        for name in order:
            start = time.perf_counter()
            logits = models[name](x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1))
            if name == "moe":
                loss = loss + moe_aux_loss(models[name])
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
    pairs = [m / d for m, d in zip(times["moe"], times["dense"], strict=True)]
    q = statistics.quantiles(pairs, n=4)
    moe, dense = models["moe"], models["dense"]
    active = moe.num_params(active=True)
    dense_params = sum(p.numel() for p in dense.parameters()) - dense.transformer.wpe.weight.numel()
    capacity = "dropless" if args.capacity_factor is None else f"capacity_factor={args.capacity_factor}"
    print(f"\nshape {args.shape}: {shape}, {capacity}, {args.threads} thread(s)")
    print(f"MoE: {moe.num_params():,} parameters, {active:,} active per token; dense: {dense_params:,}")
    print(f"median step: MoE {statistics.median(times['moe']) * 1e3:.2f} ms, "
          f"dense {statistics.median(times['dense']) * 1e3:.2f} ms")  # fmt: skip
    print(f"ratio MoE / dense (same active parameters, same tokens): {statistics.median(pairs):.3f} "
          f"(median of {len(pairs)} back-to-back pairs; quartiles {q[0]:.3f}-{q[2]:.3f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("both", "volume", "time"), default="both")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--capacity-factor", type=float, default=1.25, help="MoE of the timing part; 0: dropless"
    )
    parser.add_argument("--worker", choices=("volume",), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.capacity_factor == 0:
        args.capacity_factor = None
    if args.worker == "volume":
        _volume_worker(args)
        return
    from benchmarks.common import launch, machine

    print(machine())
    if args.part in ("both", "volume"):
        out = launch("benchmarks.moe", ["--worker", "volume", "--shape", args.shape], nprocs=2, timeout_s=600)
        _summarize_volume([json.loads((out / f"volume.rank{r}.json").read_text()) for r in range(2)])
    if args.part in ("both", "time"):
        _time(args)


if __name__ == "__main__":
    main()
