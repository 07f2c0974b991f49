"""The longest sequence that trains on one device: a 1.3B Llama-style model, bf16-mixed, full checkpointing.

    PYTHONPATH=. python -m benchmarks.long_context --json OUT.json   # the lent GPU (scripts/gpu_check.sh)
    PYTHONPATH=. python -m benchmarks.long_context --tiny --cpu      # seconds: the code path on a CPU

The one-device baseline of a context-parallel claim (docs/context_parallel.md): with
``context_parallel=C`` the activations inside the block stack fall as 1/C, so the sequence that
fits grows until the replicated parts (embedding output, logits, loss over the whole sequence)
fill the device. Hugging Face ``LlamaForCausalLM`` (rotary positions, so no weight grows with the
sequence; hidden 2048, 24 layers, 16 heads, MLP 5632, vocabulary 32000: 1.3B parameters, SDPA
attention), AdamW, ``Trainer(precision="bf16-mixed",
strategy=HybridParallelStrategy(activation_checkpointing="full"))``, one sequence per step. The
length doubles from ``--start`` until a step runs out of memory or ``--budget-s`` is spent; each
length trains 2 steps (the second timed). Prints and writes (``--json``) per length: trained or
out of memory, step time, tokens/s, peak memory; and the longest that trained.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks.common import machine, quiet_lightning, table

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=320),
    "1.3b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000),
}  # fmt: skip


def _module(shape: dict[str, Any], length: int) -> Any:
    import lightning as L
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    class LongContext(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(**shape, max_position_embeddings=length, use_cache=False,
                                 attn_implementation="sdpa")  # fmt: skip
            with torch.device(
                "cuda" if torch.cuda.is_available() else "cpu"
            ):  # a 1.3B init on the CPU takes seconds
                self.model = LlamaForCausalLM(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(input_ids=x).logits
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LongContext()


class _StepClock:
    """The second step's seconds (the first pays for allocation and kernel selection)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def callback(self) -> Any:
        from lightning.pytorch.callbacks import Callback

        clock = self

        class Clock(Callback):
            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                clock._start = time.perf_counter()

            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                clock.seconds.append(time.perf_counter() - clock._start)

        return Clock()


def train(shape: dict[str, Any], length: int, cpu: bool) -> dict[str, Any]:
    """Two steps at ``length`` tokens; ``{"trained": False}`` when the device runs out of memory."""
    import lightning as L

    from lightning_parallel import HybridParallelStrategy

    torch.manual_seed(0)
    tokens = torch.randint(shape["vocab_size"], (2, length + 1))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1
    )
    clock = _StepClock()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer = L.Trainer(
            accelerator="cpu" if cpu else "gpu", devices=1, max_steps=2, precision="bf16-mixed", logger=False,
            strategy=HybridParallelStrategy(activation_checkpointing="full"), enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[clock.callback()],
        )  # fmt: skip
        trainer.fit(_module(shape, length), data)
    except torch.OutOfMemoryError:
        return {"length": length, "trained": False}
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    step = clock.seconds[-1]
    return {
        "length": length,
        "trained": True,
        "step_s": step,
        "tokens_per_s": length / step,
        "peak_gib": peak,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the code path)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU")
    parser.add_argument("--start", type=int, default=None, help="first length (default 8192; tiny: 64)")
    parser.add_argument(
        "--max-length", type=int, default=None, help="stop after this length (default 2^20; tiny: 256)"
    )
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no new length after this long")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    quiet_lightning()
    shape = SHAPES["tiny" if args.tiny else "1.3b"]
    length = args.start or (64 if args.tiny else 8192)
    stop = args.max_length or (256 if args.tiny else 2**20)
    start, results = time.perf_counter(), []
    while length <= stop and time.perf_counter() - start < args.budget_s:
        results.append(train(shape, length, args.cpu))
        print(json.dumps(results[-1]), flush=True)
        if not results[-1]["trained"]:
            break
        length *= 2
    trained = [r["length"] for r in results if r["trained"]]
    summary = {"machine": machine(), "shape": shape, "results": results, "longest": max(trained, default=None),
               "out_of_memory_at": next((r["length"] for r in results if not r["trained"]), None)}  # fmt: skip
    rows = [[r["length"], "yes" if r["trained"] else "out of memory",
             f"{r['step_s'] * 1e3:.0f} ms" if r["trained"] else "-",
             f"{r['tokens_per_s']:.0f}" if r["trained"] else "-",
             f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "-"] for r in results]  # fmt: skip
    print(f"# {machine()}\n" + table(["tokens", "trained", "step", "tokens/s", "peak memory"], rows))
    print(f"longest sequence trained: {summary['longest']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
