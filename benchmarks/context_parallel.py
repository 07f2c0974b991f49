"""Context parallelism on 2 CPU ranks against one process, at long sequences; and its bytes against theory.

    python -m benchmarks.context_parallel                     # sequence 4096, tiny recipe GPT, ring and Ulysses
    python -m benchmarks.context_parallel --length 2048 --steps 4

Each of the 2 ranks (``common.launch``; one torch thread each) runs three configurations in ONE
launch, their training steps interleaved one by one (``common.run_lockstep``):

- ``one process``: the recipe GPT's training step (forward, cross-entropy, backward, SGD step) in
  plain PyTorch on the whole sequence: what one device does alone (each rank runs its own copy,
  at the same time, so both cores are as busy as under context parallelism);
- ``cp2 ring`` and ``cp2 ulysses``: ``Trainer(strategy=HybridParallelStrategy(context_parallel=2,
  context_parallel_mode=...))``, the same model, batches and optimizer: each rank holds half of
  every sequence.

Printed: median step times and the paired ratios cp2 / one process (below 1: context parallelism
is faster per sequence; the attention work per rank falls to 1/2, the matmuls outside attention
to 1/2, communication is added). Then, from one more step of each mode counted by
``lightning_parallel.context_parallel.TRAFFIC``, the bytes this rank sent against the theory for
B sequences of T tokens, width E, KV width E_kv (= E here), L blocks, C ranks, fp32:

- ring, per block: forward ``(C-1)`` hops of this rank's keys and values (``2 B T/C E_kv`` values),
  backward ``(C-1)`` hops of them again and ``C`` hops of their fp32 gradients;
- Ulysses, per block: queries, keys, values and output, ``(C-1)/C`` of each forward and again
  backward (``B T/C (2E + 2E_kv)`` values per direction, times ``(C-1)/C``);
- both: leaving the stack, the hidden state's all-gather (``B T/C E`` values to each of the
  ``C-1`` others).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Baton,
    LockstepTimer,
    Timings,
    compare,
    finish_worker,
    init_process_group,
    launch,
    launch_env,
    machine,
    quiet_lightning,
    recipe_data,
    recipe_model,
    run_lockstep,
    table,
)

SHAPE = dict(n_layer=2, n_head=4, n_embd=64)
BATCH, C = 1, 2
MODES = ("ring", "ulysses")


def _model(length: int) -> Any:
    return recipe_model(seed=1234, block_size=length, **SHAPE)


def _one_process(baton: Baton, name: str, data: Any, args: argparse.Namespace) -> Timings:
    """The step one device runs alone, in plain PyTorch (no Trainer: this rank's process group holds 2)."""
    import torch.nn.functional as F

    model = _model(args.length)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times: list[float] = []
    loader = data.train_dataloader()
    for index, (x, y) in zip(range(args.warmup + args.steps), loader, strict=False):
        baton.pass_on(name)
        start = time.perf_counter()
        logits = model(x[:BATCH])
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[:BATCH].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    return {"step": times}


def _fit(mode: str, data: Any, args: argparse.Namespace, callbacks: list[Any], steps: int) -> None:
    import lightning as L

    from lightning_parallel import HybridParallelStrategy

    model = _model(args.length)
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=1e-3)  # type: ignore[method-assign]
    strategy = HybridParallelStrategy(context_parallel=C, context_parallel_mode=mode, timeout=600)
    trainer = L.Trainer(
        accelerator="cpu", devices=C, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, datamodule=recipe_data(args.length, BATCH, like=data))


def _bytes_of_one_step(
    mode: str, data: Any, args: argparse.Namespace, dist_env: dict[str, str]
) -> dict[str, int]:
    from lightning.pytorch.callbacks import Callback

    from lightning_parallel.context_parallel import TRAFFIC

    class Count(Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            TRAFFIC.reset()  # the setup's verification of the split is not part of a step

        def on_train_batch_end(self, *a: Any) -> None:
            self.bytes = TRAFFIC.snapshot()

    count = Count()
    os.environ.update(dist_env)
    _fit(mode, data, args, [count], steps=1)
    return count.bytes


def theory(mode: str, length: int) -> dict[str, int]:
    """Bytes one rank sends in one training step (module docstring), fp32, E_kv = E."""
    local = BATCH * length // C * SHAPE["n_embd"] * 4  # one (B, T/C, E) fp32 tensor
    gathered = (C - 1) * local
    if mode == "ring":
        kv = 2 * local
        return {"ring": SHAPE["n_layer"] * ((C - 1) * kv + (C - 1) * kv + C * kv), "all_gather": gathered}
    per_direction = (C - 1) * 4 * local // C  # q, k, v, out
    return {"all_to_all": SHAPE["n_layer"] * 2 * per_direction, "all_gather": gathered}


def worker(args: argparse.Namespace) -> None:
    quiet_lightning()
    torch.set_num_threads(1)
    dist_env = launch_env()
    rank = init_process_group(timeout_s=600)
    data = recipe_data(
        args.length, BATCH, random_tokens=BATCH * (args.length + 1) * (args.steps + args.warmup + 2) * C
    )
    data.setup("fit")

    def cp(mode: str) -> Any:
        def run(baton: Baton, name: str) -> Timings:
            timer = LockstepTimer(baton, name, warmup=args.warmup)
            _fit(mode, data, args, [timer], steps=args.steps + args.warmup)
            return timer.result()

        return run

    runs = {"one process": lambda baton, name: _one_process(baton, name, data, args)}
    runs.update({f"cp2 {mode}": cp(mode) for mode in MODES})
    rounds = []
    for index in range(args.rounds):
        os.environ.update(dist_env)
        names = list(runs) if index % 2 == 0 else list(runs)[::-1]
        rounds.append(run_lockstep({name: runs[name] for name in names}))
    sent = {mode: _bytes_of_one_step(mode, data, args, dist_env) for mode in MODES}
    if rank == 0:
        (args.out / "context_parallel.json").write_text(json.dumps({"rounds": rounds, "bytes": sent}))
    finish_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    forwarded = ["--worker", "--length", str(args.length), "--rounds", str(args.rounds), "--steps",
                 str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
    start = time.perf_counter()
    out = launch("benchmarks.context_parallel", forwarded, nprocs=C, timeout_s=3600)
    result = json.loads((out / "context_parallel.json").read_text())
    print(f"# {machine()}; 2 ranks x 1 torch thread, gloo; recipe GPT {SHAPE}, batch {BATCH} x {args.length}"
          f" tokens; {args.rounds} rounds x {args.steps} timed steps, interleaved; {time.perf_counter() - start:.0f} s\n")  # fmt: skip
    rows = []
    for mode in MODES:
        c = compare(result["rounds"], "one process", f"cp2 {mode}")
        rows.append([f"cp2 {mode}", f"{c['reference_s'] * 1e3:.0f} ms", f"{c['candidate_s'] * 1e3:.0f} ms",
                     f"{c['ratio']:.3f} ({c['q1']:.3f}-{c['q3']:.3f})"])  # fmt: skip
    print(
        table(["configuration", "one process step", "cp2 step", "ratio cp2 / one process (quartiles)"], rows)
    )
    print("\nbytes sent by rank 0 in one training step, against the theory:")
    rows = []
    for mode in MODES:
        for kind, expected in theory(mode, args.length).items():
            got = result["bytes"][mode].get(kind, 0)
            rows.append([mode, kind, f"{got:,}", f"{expected:,}", f"{got / expected:.3f}"])
    print(table(["mode", "collective", "measured", "theory", "ratio"], rows))


if __name__ == "__main__":
    main()
