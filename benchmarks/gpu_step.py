"""One GPU, bf16-mixed: plain PyTorch eager vs Lightning vs ``HybridParallelStrategy()`` vs torch.compile.

    PYTHONPATH=. python -m benchmarks.gpu_step                # GPT-1.3B, batch 8 x 2048 (scripts/gpu_check.sh)
    PYTHONPATH=. python -m benchmarks.gpu_step --tiny --cpu   # the same code paths, tiny model, on CPU

The model is the recipe's ``GPTLightningModule`` (GPT-3 XL shape: 24 layers, width 2048, 16
heads, vocabulary 50304, context 2048), the data random tokens, the optimizer the module's own
(AdamW, decay on matrices, warmup + cosine per step). Phases, in this order, in ONE process:

1. ``eager``: a plain PyTorch loop on ``module.model``: ``torch.autocast(bfloat16)`` around
   forward and loss, ``backward``, ``optimizer.step``, ``scheduler.step``, ``zero_grad``.
2. ``lightning``: ``Trainer(strategy="auto", precision="bf16-mixed")`` (Lightning's own cost).
3. ``strategy``: ``Trainer(strategy=HybridParallelStrategy(), precision="bf16-mixed")``, all
   degrees 1.
4. ``eager again``: phase 1 repeated, to see drift; the eager reference is the mean of 1 and 4.
5. ``compile``: phase 1 with ``torch.compile(model)``.
6. ``strategy compiled, full checkpointing`` (with ``--compile-only``, gpu_check's compile phase): phase 3 with
   ``compile=True, activation_checkpointing="full"``: each block compiled with its recomputation inside.

Every phase builds its model from the same seed and trains on the same batches; each step is
timed between two device synchronisations (Lightning phases by a callback from
``on_train_batch_start`` to ``on_train_batch_end``); the first ``--warmup`` steps (compilation,
allocator warm-up) are not timed. MFU counts 6 N + 12 L H T FLOPs per token (N parameters
without the position embedding, the tied head counted once; causal attention counted in full,
as nanoGPT and the reference table do) against the device's dense bf16 peak
(``lightning_parallel.plans.flops.peak_flops``: about 989 TFLOP/s on an H100 SXM and an H200, 756 on an
H100 PCIe; 989.5 where the device is unknown or a CPU, where the figure means nothing).
Peak memory is ``torch.cuda.max_memory_allocated`` of each phase. The first-step losses of all
phases must agree (same weights, same batch): a self-check that they train the same thing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.common import StepTimer, machine, quiet_lightning, table

PEAK_TFLOPS = 989.5  # H100 SXM and H200, dense bf16: the figure used where the device's peak is unknown
LARGE = dict(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048, batch_size=8)
TINY = dict(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_embd=64, batch_size=4)
TARGET = 1.02  # strategy / eager


def _module(shape: dict[str, Any], device: torch.device) -> Any:
    from recipes.gpt.module import GPTLightningModule

    torch.manual_seed(1234)
    with device:  # initialise on the device: 1.3B parameters are slow to initialise on the CPU
        return GPTLightningModule(
            **{k: v for k, v in shape.items() if k != "batch_size"},
            dropout=0.0,
            warmup_steps=10,
            lr_decay_steps=1000,
        )


def _module_params(shape: dict[str, Any]) -> int:
    """Parameters without the position embedding (the tied head once), from the shape alone."""
    from recipes.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**{k: v for k, v in shape.items() if k != "batch_size"}))
    return model.num_params()


def _batches(shape: dict[str, Any], count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocab_size"], (count, shape["batch_size"], shape["block_size"] + 1),
                           generator=generator)  # fmt: skip
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _held_gib(device: torch.device) -> float:
    """Memory still allocated before a phase starts: what earlier phases leaked (should be ~0)."""
    gc.collect()
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def run_plain(shape: dict[str, Any], batches: list, device: torch.device, steps: int, warmup: int,
              compile: bool = False) -> dict[str, Any]:  # fmt: skip
    """The reference loop: what a user writes without Lightning."""
    import torch.nn.functional as F

    _reset_memory(device)
    module = _module(shape, device)
    model = module.model
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    forward = torch.compile(model) if compile else model
    times, losses = [], []
    for index in range(warmup + steps):
        x, y = (t.to(device, non_blocking=True) for t in batches[index % len(batches)])
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
        if index == 0:
            losses.append(loss.item())
    result = {"times": times, "first_loss": losses[0], "peak_gib": _peak_gib(device)}
    del module, model, forward, optimizer, scheduler, config
    return result


def run_lightning(shape: dict[str, Any], batches: list, device: torch.device, steps: int, warmup: int,
                  use_strategy: bool, **strategy_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """The same model and batches through ``Trainer.fit``."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_parallel import HybridParallelStrategy

    class FirstLoss(Callback):
        loss = float("nan")

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if batch_idx == 0:
                self.loss = outputs["loss"].item()

    _reset_memory(device)
    module = _module(shape, device)
    timer, first = StepTimer(warmup=warmup), FirstLoss()
    loader = DataLoader(batches, batch_size=None, shuffle=False)  # already batched
    trainer = L.Trainer(
        accelerator=device.type, devices=1, precision="bf16-mixed",
        strategy=HybridParallelStrategy(timeout=300, **strategy_kwargs) if use_strategy else "auto",
        max_steps=warmup + steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[timer, first],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    result = {"times": timer.times, "first_loss": first.loss, "peak_gib": _peak_gib(device)}
    del trainer, module
    return result


def _peak_flops() -> float:
    """The lent device's dense bf16 peak (an H100 PCIe has 756 TFLOP/s, not the H200's 989.5)."""
    from lightning_parallel.plans.flops import peak_flops

    if not torch.cuda.is_available():
        return PEAK_TFLOPS * 1e12
    return peak_flops(torch.device("cuda", 0), torch.bfloat16) or PEAK_TFLOPS * 1e12


def _summary(
    name: str, result: dict[str, Any], tokens: int, flops_per_token: float, reference: float | None
) -> list:
    if "error" in result:
        return [name, "FAILED", "", "", "", "", "", result["error"][:80]]
    step = statistics.median(result["times"])
    tokens_s = tokens / step
    mfu = flops_per_token * tokens_s / _peak_flops()
    ratio = f"{step / reference:.3f}x" if reference else ""
    return [name, f"{step * 1e3:.1f} ms", f"{tokens_s / 1e3:.1f}k", f"{mfu * 100:.1f}%",
            f"{result['peak_gib']:.1f} GiB", f"{result['held_gib']:.2f} GiB", f"{result['first_loss']:.4f}",
            ratio]  # fmt: skip


def _median(results: dict[str, dict[str, Any]], name: str) -> float:
    result = results.get(name, {})
    return statistics.median(result["times"]) if "times" in result else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the code paths in seconds")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per phase (default 20; tiny 5)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per phase (default 5; tiny 2)"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile phase")
    parser.add_argument(
        "--compile-only", action="store_true", help="only eager and torch.compile (gpu_check's phase 6)"
    )
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    # Lightning sets torch's CPU threads when a strategy launches processes (even one), unless
    # OMP_NUM_THREADS is set: pin the current value so every phase runs with the same.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    quiet_lightning()
    if args.cpu:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        sys.exit("No GPU: pass --cpu (with --tiny) to check the code paths on the CPU.")
    shape = TINY if args.tiny else LARGE
    steps = args.steps or (5 if args.tiny else 20)
    warmup = args.warmup or (2 if args.tiny else 5)
    batches = _batches(shape, warmup + steps)
    tokens = shape["batch_size"] * shape["block_size"]

    print(f"# {machine()}", flush=True)
    print(
        f"# GPT {shape}, bf16 autocast, AdamW; {steps} timed steps (+{warmup} warm-up) per phase", flush=True
    )
    start = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    phases = [("eager", lambda: run_plain(shape, batches, device, steps, warmup)),
              ("lightning", lambda: run_lightning(shape, batches, device, steps, warmup, use_strategy=False)),
              ("strategy", lambda: run_lightning(shape, batches, device, steps, warmup, use_strategy=True)),
              ("eager again", lambda: run_plain(shape, batches, device, steps, warmup))]  # fmt: skip
    if args.compile_only:
        phases = [phases[0]]
    if not args.no_compile:
        phases.append(("compile", lambda: run_plain(shape, batches, device, steps, warmup, compile=True)))
    if args.compile_only:
        phases.append(
            (
                "strategy compiled, full checkpointing",
                lambda: run_lightning(
                    shape,
                    batches,
                    device,
                    steps,
                    warmup,
                    use_strategy=True,
                    compile=True,
                    activation_checkpointing="full",
                ),
            )
        )
    for name, run in phases:
        phase_start = time.perf_counter()
        held = _held_gib(device)
        try:  # a failing phase (say, the strategy on another torch) must not cost the others' numbers
            results[name] = run()
        except Exception as error:  # noqa: BLE001
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"phase {name}: FAILED: {results[name]['error']}", flush=True)
            _reset_memory(device)
            continue
        results[name]["held_gib"] = held
        print(f"phase {name}: median {_median(results, name) * 1e3:.1f} ms/step,"
              f" {time.perf_counter() - phase_start:.0f} s", flush=True)  # fmt: skip

    num_params = _module_params(shape)
    flops_per_token = 6 * num_params + 12 * shape["n_layer"] * shape["n_embd"] * shape["block_size"]
    eager = statistics.fmean([_median(results, n) for n in ("eager", "eager again") if n in results])
    rows = [_summary(name, result, tokens, flops_per_token, eager) for name, result in results.items()]
    print(f"\n# {num_params / 1e9:.3f}B parameters (without position embeddings), {flops_per_token / 1e9:.2f}"
          f" GFLOP/token, {tokens} tokens/step, {time.perf_counter() - start:.0f} s in all\n")  # fmt: skip
    header = ["phase", "step", "tokens/s", "MFU", "peak memory", "held before", "first loss", "vs eager"]
    print(table(header, rows))
    if args.compile_only:
        print(f"RESULT compile / eager = {_median(results, 'compile') / eager:.3f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine(), "shape": shape, "results": results}, f, indent=1)
        return
    ratio = _median(results, "strategy") / eager
    lightning_ratio = _median(results, "lightning") / eager
    print(
        f"\nRESULT strategy / eager = {ratio:.3f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'MISSED'})"
    )
    print(
        f"RESULT lightning / eager = {lightning_ratio:.3f}; strategy / lightning = {ratio / lightning_ratio:.3f}"
    )
    print(
        f"RESULT eager again / eager = {_median(results, 'eager again') / _median(results, 'eager'):.3f} (drift)"
    )
    if "compile" in results:
        print(f"RESULT compile / eager = {_median(results, 'compile') / eager:.3f}")
    failed = [name for name, result in results.items() if "error" in result]
    losses = [r["first_loss"] for r in results.values() if "first_loss" in r]
    agree = bool(losses) and max(losses) - min(losses) <= 0.02 * abs(losses[0]) + 1e-3
    print(
        f"RESULT first-step losses {'agree' if agree else 'DISAGREE'}: {', '.join(f'{v:.4f}' for v in losses)}"
    )
    if args.json:
        payload = {"machine": machine(), "shape": shape, "steps": steps, "warmup": warmup,
                   "flops_per_token": flops_per_token, "results": results, "strategy_over_eager": ratio}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    if failed:
        sys.exit(f"Phases failed: {', '.join(failed)}")
    if not agree:
        sys.exit("The phases did not start from the same loss: they do not train the same model.")
    if os.environ.get("GPU_STEP_STRICT") and ratio > TARGET:
        sys.exit(f"strategy / eager = {ratio:.3f} > {TARGET}")


if __name__ == "__main__":
    main()
