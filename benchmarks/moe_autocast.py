"""A Hugging Face MoE model under bf16 autocast: torch alone against torch with the precision plugins' grouped rule.

    PYTHONPATH=. python -m benchmarks.moe_autocast                 # the lent GPU: Qwen3-MoE, 1024 wide, 8 experts
    PYTHONPATH=. python -m benchmarks.moe_autocast --tiny --cpu    # the same code paths in seconds

transformers computes the experts of its MoE families with ``torch._grouped_mm``, which torch gives no
autocast rule: under plain ``torch.autocast(bfloat16)`` with fp32 weights they stay fp32 (on a GPU,
torch's fp32 fallback instead of its grouped bf16 kernel). The precision plugins register one
(``lightning_parallel/precision/grouped_mm_autocast.py``). Both configurations train the same model from
the same weights on the same batches, interleaved step by step; printed and written (``--json``): the
dtypes of the grouped products each computed (counted by a dispatch mode), the step time of each and
their ratio, and the first loss of each (the same model: within bf16 rounding). The peer is plain
PyTorch autocast, what a user of transformers runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import machine, table
from lightning_parallel.precision import grouped_mm_autocast as rule

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=4, layers=2,
                 heads=4, kv_heads=2, vocab_size=256, sequence=64, batch=2),
    "gpu": dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704, num_experts=8, layers=4,
                heads=16, kv_heads=4, vocab_size=32000, sequence=2048, batch=4),
}  # fmt: skip
CONFIGS = ("torch autocast alone", "with the grouped rule")


class GroupedDtypes(TorchDispatchMode):
    """Counts the grouped matmuls by the dtype of their output."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if "grouped_mm" in str(func):
            self.counts[str(out.dtype).split(".")[-1]] += 1
        return out


def build(shape: dict[str, Any], device: torch.device) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        moe_intermediate_size=shape["moe_intermediate_size"], num_experts=shape["num_experts"],
        num_experts_per_tok=2, num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["hidden_size"] // shape["heads"],
        vocab_size=shape["vocab_size"], max_position_embeddings=shape["sequence"], decoder_sparse_step=1,
    )  # fmt: skip
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def step(model: Any, tokens: torch.Tensor, device: torch.device, count: bool) -> tuple[float, float, Counter]:
    counter = GroupedDtypes()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.autocast(device.type, torch.bfloat16), counter if count else nullcontext():
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed, float(loss.detach()), counter.counts


def run(shape: dict[str, Any], device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    model = build(shape, device)
    generator = torch.Generator().manual_seed(1)
    tokens = [
        torch.randint(shape["vocab_size"], (shape["batch"], shape["sequence"]), generator=generator).to(
            device
        )
        for _ in range(steps + warmup)
    ]
    results: dict[str, dict[str, Any]] = {name: {"times": [], "grouped": {}} for name in CONFIGS}
    for index, batch in enumerate(tokens):
        for name in CONFIGS:  # interleaved: drift of a shared machine hits both alike
            if "error" in results[name]:
                continue
            if name == CONFIGS[0]:
                rule.unregister_grouped_mm_autocast()
            else:
                rule.register_grouped_mm_autocast()
            try:
                seconds, loss, grouped = step(model, batch, device, count=index == 0)
            except Exception as error:  # noqa: BLE001 - one configuration failing must not cost the other's figures
                results[name]["error"] = f"{type(error).__name__}: {error}"[:300]
                model.zero_grad(set_to_none=True)
                continue
            if index == 0:
                results[name].update(first_loss=loss, grouped=dict(grouped))
            elif index >= warmup:
                results[name]["times"].append(seconds)
    rule.register_grouped_mm_autocast()
    out: dict[str, Any] = {"configs": results}
    for result in results.values():
        if result["times"]:
            result["step_s"] = statistics.median(result["times"])
        total = sum(result["grouped"].values())
        result["bf16_share"] = result["grouped"].get("bfloat16", 0) / total if total else None
    ruled, alone = results[CONFIGS[1]], results[CONFIGS[0]]
    out["bf16_share"] = ruled["bf16_share"]
    if "step_s" in ruled and "step_s" in alone:
        out["rule_over_alone"] = ruled["step_s"] / alone["step_s"]
        out["first_loss_diff"] = abs(ruled["first_loss"] - alone["first_loss"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; tiny 3)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    shape = SHAPES["tiny" if args.tiny or device.type == "cpu" else "gpu"]
    steps = args.steps or (3 if args.tiny else 10)
    print(
        f"# moe_autocast: Qwen3-MoE {shape}, {steps} steps after {args.warmup}, {device}; {machine()}",
        flush=True,
    )
    out = run(shape, device, steps, args.warmup)
    rows = [[name, json.dumps(r["grouped"]), f"{r['step_s'] * 1e3:.1f} ms" if "step_s" in r else r.get("error", ""),
             f"{r['first_loss']:.4f}" if "first_loss" in r else ""] for name, r in out["configs"].items()]  # fmt: skip
    print(table(["configuration", "grouped products by dtype", "step", "first loss"], rows))
    print(
        f"with the rule / torch alone: {out.get('rule_over_alone', float('nan')):.3f}x; bf16 share {out['bf16_share']}"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"shape": shape, "device": str(device), **out}, handle, indent=1)


if __name__ == "__main__":
    main()
