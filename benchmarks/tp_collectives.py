"""Collectives per training step of the recipe GPT at tensor_parallel=2, against the Megatron minimum.

    python -m benchmarks.tp_collectives            # tp=2 without/with SP, default and loss_parallel=True,
                                                   # then without/with gradient clipping (2 gloo processes)
    python -m benchmarks.tp_collectives --events   # also every collective, in order, with where it came from

What is counted: every collective issued during one training step (forward, backward, optimizer
step) on rank 0, seen by a ``TorchDispatchMode``: the functional collectives DTensor uses
(``torch.ops._c10d_functional.{all_reduce, all_gather_into_tensor, reduce_scatter_tensor, ...}``)
and eager ``torch.distributed`` calls (``torch.ops.c10d.allreduce_`` ..., e.g. gradient norms).
Each is attributed to the module running it (forward: hooks around each module, including the
module's own input/output redistributions; backward: tensor hooks on each module's output and
input gradients) and sized by its *tensor* elements: the all-reduced tensor, the all-gather's
output, the reduce-scatter's input. Bytes are those elements times the element size (wire
bytes per rank of a ring are 2(p-1)/p of that for an all-reduce, (p-1)/p for the others).

The Megatron minimum (Shoeybi et al. 2019; Korthikanti et al. 2022), for batch B, sequence T,
width H, vocabulary V, L layers, tensor-parallel degree p > 1, activations of B*T*H elements:

- Each transformer layer, without sequence parallelism: attention and MLP are each a column-
  parallel entry and a row-parallel exit. Forward: one all-reduce after each exit ("g"), 2 in
  all. Backward: one all-reduce of the input gradient of each block ("f"), 2 in all.
  With sequence parallelism the all-reduce is split into its halves and the norms/dropout run on
  sequence shards: forward, an all-gather before each entry and a reduce-scatter after each
  exit (2 + 2); backward the same (the all-gather's backward is a reduce-scatter and vice versa),
  plus one all-gather of each entry's input, which Megatron keeps as the rank's sequence shard and
  gathers again for the weight gradient (Korthikanti et al. 2022, 4.2.2; ``memory/regather.py``): 2 + 4.
  The norms' weights are replicated while their inputs are sequence shards, so their gradients
  are partial sums: Megatron all-reduces them over the TP group once per step, all layers
  coalesced into ONE all-reduce of 2H per norm (weight and bias) after the backward.
- Token embedding, vocabulary-parallel: forward one all-reduce (each rank looked up only its
  rows); with SP a reduce-scatter instead (its output is sequence-sharded), whose backward is an
  all-gather. The position embedding is replicated: nothing.
- Output head, tied to the embedding, column-parallel over the vocabulary: its input is
  replicated, so the backward all-reduces its input gradient ("f"); with SP the forward all-
  gathers the sequence-sharded input and the backward reduce-scatters the gradient. Megatron's
  loss is vocabulary-parallel: the logits stay sharded and the cross-entropy all-reduces three
  B*T tensors (max logit, sum of exponentials, target logit) forward, nothing backward.
  Ours by default all-gathers the logits (B*T*V elements forward; the backward only slices) so
  that the user's unchanged ``F.cross_entropy`` sees full logits: V/H (here 5x; GPT-2/3 with
  V=50304, H=2048: 25x) more bytes than one activation collective, and 3 small all-reduces
  fewer. ``HybridParallelStrategy(loss_parallel=True)`` keeps the logits sharded and computes
  the loss on the shards (torch's ``loss_parallel``): Megatron's scheme.
- Optimizer step: with ``gradient_clip_val`` the global gradient norm needs one all-reduce of
  one element over the model-parallel group; without clipping, nothing.

The test ``tests/benchmarks/test_collective_count.py`` asserts that every layer's collectives
equal the minimum exactly (counted, not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    ROOT,
    finish_worker,
    init_process_group,
    launch,
    launch_env,
    machine,
    quiet_lightning,
    recipe_data,
    recipe_model,
    table,
)

# The measured model: small, with B*T*H, B*T*V, B*T and H all different so sizes identify roles.
SHAPE = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=320)
BATCH = 4
TP = 2

AR, AG, RS = "all_reduce", "all_gather", "reduce_scatter"
CATEGORIES = ("layer", "embedding", "final norm + head", "loss", "optimizer step", "other")


# ---- recording ----------------------------------------------------------------------------


def _collective_ops() -> dict[Any, tuple[str, str]]:
    """Collective op packets -> (kind, which argument holds the full tensor)."""
    f, c = torch.ops._c10d_functional, torch.ops.c10d
    ops = {
        f.all_reduce: (AR, "arg0"), f.all_reduce_: (AR, "arg0"), f.all_reduce_coalesced: (AR, "arg0"),
        f.all_gather_into_tensor: (AG, "out"), f.all_gather_into_tensor_coalesced: (AG, "out"),
        f.reduce_scatter_tensor: (RS, "arg0"), f.reduce_scatter_tensor_coalesced: (RS, "arg0"),
        f.all_to_all_single: ("all_to_all", "arg0"), f.broadcast: ("broadcast", "arg0"),
        c.allreduce_: (AR, "arg0"), c.allreduce_coalesced_: (AR, "arg0"),
        c._allgather_base_: (AG, "arg0"), c.allgather_: (AG, "arg0"),
        c.allgather_into_tensor_coalesced_: (AG, "arg0"),
        c._reduce_scatter_base_: (RS, "arg1"), c.reduce_scatter_: (RS, "arg1"),
        c.reduce_scatter_tensor_coalesced_: (RS, "arg1"),
        c.alltoall_base_: ("all_to_all", "arg1"), c.alltoall_: ("all_to_all", "arg1"),
        c.broadcast_: ("broadcast", "arg0"), c.reduce_: ("reduce", "arg0"), c.gather_: ("gather", "arg1"),
        c.scatter_: ("scatter", "arg0"), c.barrier: ("barrier", "none"),
    }  # fmt: skip
    return ops


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


_INTERNAL = tuple(
    os.sep + os.path.join("torch", *parts)
    for parts in (
        ("distributed", ""),
        ("utils", ""),
        ("_",),
        ("autograd", ""),
        ("nn", "modules", "module.py"),
    )
)
_INTERNAL += (__file__,)  # fmt: skip


def _source() -> str:
    """``file:line function`` of the innermost frame outside torch's collective and hook machinery."""
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in _INTERNAL):
            path = frame.filename.split("site-packages" + os.sep)[-1].replace(str(ROOT) + os.sep, "")
            return f"{path}:{frame.lineno} {frame.name}"
    return "autograd engine"


@dataclass
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, ...
    op: str  # the dispatcher op, e.g. _c10d_functional.all_reduce.default
    elements: int  # elements of the full tensor (all-reduced / gathered output / scattered input)
    bytes: int
    phase: str  # forward, backward, optimizer
    where: str  # innermost tracked module (names relative to the LightningModule), or a step phase
    source: str  # the innermost Python frame outside torch.distributed/torch.utils that issued it
    time_s: float  # when it was issued, seconds after the recording started


class _Frame:
    def __init__(self, label: str, depth: int) -> None:
        self.label, self.depth = label, depth


class CollectiveRecorder:
    """Record every collective while active, attributed to (phase, module).

    Tracked modules: the blocks (an inner frame: the block's own ``forward``; an outer frame
    ``"<block> (hooks)"``: also the strategy's hooks on the block, i.e. the sequence-parallel
    region entry/exit), the blocks' direct children (attention, MLP, norms), and every module
    outside the block stack. Submodules of containers are not tracked: the strategy feeds the
    container's projections a shared input, so their own input gradients never exist.
    """

    def __init__(self, root: torch.nn.Module, block_names: list[str]) -> None:
        self.root, self.block_names = root, block_names
        self.events: list[Collective] = []
        self.phase = "forward"
        self.start = time.perf_counter()
        self.marks: dict[str, float] = {}  # phase changes, seconds after the start
        self._ops = _collective_ops()
        self._stack: list[_Frame] = []  # forward
        self._active: list[_Frame] = []  # backward
        self._handles: list[Any] = []
        self._mode: Any = None

    # tracked modules and their frames
    def _tracked(self) -> list[tuple[str, torch.nn.Module, bool]]:
        blocks = set(self.block_names)
        out = []
        for name, module in self.root.named_modules():
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            inside = any(name.startswith(b + ".") for b in blocks)
            if name and (name in blocks or not inside or parent in blocks):
                out.append((name, module, name in blocks))
        return out

    def _install(self, label: str, module: torch.nn.Module, outer: bool) -> None:
        # outer=True: the frame includes the module's hooks (pre-hook first, post-hook last).
        def pre(mod: Any, args: tuple) -> None:
            frame = _Frame(label, len(self._stack))
            self._stack.append(frame)
            for t in _tensors(args):
                if t.requires_grad:
                    t.register_hook(lambda g, f=frame: self._pop(f))
                    break

        def post(mod: Any, args: tuple, output: Any) -> None:
            frame = self._stack.pop()
            assert frame.label == label, (frame.label, label)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda g, f=frame: self._active.append(f))
                    break

        self._handles.append(module.register_forward_pre_hook(pre, prepend=outer))
        self._handles.append(module.register_forward_hook(post, prepend=not outer))

    def _pop(self, frame: _Frame) -> None:
        if frame in self._active:
            self._active.remove(frame)

    def where(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            if not self._active:
                return "<backward>"
            return max(reversed(self._active), key=lambda f: f.depth).label
        return self._stack[-1].label if self._stack else f"<{self.phase}>"

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        kind, source = self._ops[func._overloadpacket]
        if source == "none":
            tensors: list[torch.Tensor] = []
        elif source == "out":
            tensors = _tensors(out)
        else:
            tensors = _tensors(args[int(source[3:])])
        elements = sum(t.numel() for t in tensors)
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase
        self.events.append(Collective(kind, str(func), elements, sum(t.numel() * t.element_size() for t in tensors),
                                      phase, self.where(), _source(), time.perf_counter() - self.start))  # fmt: skip

    def __enter__(self) -> CollectiveRecorder:
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented  # let DTensor run; its own collectives come back here
                out = func(*args, **kwargs)
                if func._overloadpacket in recorder._ops:
                    recorder.record(func, args, kwargs, out)
                return out

        for name, module, is_block in self._tracked():
            self._install(f"{name} (hooks)" if is_block else name, module, outer=True)
            if is_block:
                self._install(name, module, outer=False)
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []


def CollectiveCounter(step: int = 1) -> Any:  # noqa: N802 (Lightning imported lazily)
    """Callback: record the collectives of training batch ``step`` (after warm-up) on this rank."""
    from lightning.pytorch.callbacks import Callback

    class _Counter(Callback):
        def __init__(self) -> None:
            self.recorder: CollectiveRecorder | None = None
            self.events: list[Collective] = []
            self.marks: dict[str, float] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == step:
                plan = getattr(trainer.strategy, "plan", None)
                self.recorder = CollectiveRecorder(
                    pl_module, list(plan.block_names) if plan else []
                ).__enter__()

        def _mark(self, phase: str) -> None:
            if self.recorder is not None:
                self.recorder.phase = phase
                self.recorder.marks[phase] = time.perf_counter() - self.recorder.start

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._mark("backward")

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self._mark("optimizer")

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if self.recorder is not None:
                self.recorder.__exit__(None, None, None)
                self.events, self.marks, self.recorder = self.recorder.events, self.recorder.marks, None

    return _Counter()


# ---- categories and the minimum -----------------------------------------------------------


def categorize(event: dict, block_names: list[str]) -> tuple[str, int | None]:
    """(category, layer index or None) of a recorded collective of the recipe GPT.

    The sequence-parallel region's entry (first block's hook) counts with the embedding and its
    exit (last block's hook) with the head: Megatron's embedding reduce-scatters into the region
    and its head all-gathers out of it, so that is where the minimum has them.
    """
    where = event["where"]
    if event["phase"] == "optimizer":
        return "optimizer step", None
    for index, block in enumerate(block_names):
        if where == f"{block} (hooks)":
            return ("embedding" if index == 0 else "final norm + head"), None
        if where == block or where.startswith(block + "."):
            return "layer", index
    leaf = where.rsplit(".", 1)[-1]
    if leaf in ("wte", "wpe", "drop"):
        return "embedding", None
    if leaf in ("ln_f", "lm_head"):
        return "final norm + head", None
    if where in ("<forward>", "<backward>", "model"):
        return "loss", None
    return "other", None


Signature = tuple[str, str, int]  # (phase, kind, elements)


def megatron_minimum(sp: bool, clip: bool) -> dict[str, Counter]:
    """Minimum collectives per category for the measured shape (see the module docstring)."""
    B, T, H = BATCH, SHAPE["block_size"], SHAPE["n_embd"]
    act = B * T * H
    if sp:
        layer = Counter({("forward", AG, act): 2, ("forward", RS, act): 2,
                         ("backward", AG, act): 4, ("backward", RS, act): 2})  # fmt: skip
        embedding = Counter({("forward", RS, act): 1, ("backward", AG, act): 1})
        head = Counter({("forward", AG, act): 1, ("backward", RS, act): 1})
        norms = 2 * SHAPE["n_layer"] + 1  # ln_1, ln_2 of every layer and ln_f; weight and bias each
        optimizer = Counter({("optimizer", AR, 2 * H * norms): 1})
    else:
        layer = Counter({("forward", AR, act): 2, ("backward", AR, act): 2})
        embedding = Counter({("forward", AR, act): 1})
        head = Counter({("backward", AR, act): 1})
        optimizer = Counter()
    if clip:
        optimizer[("optimizer", AR, 1)] += 1
    loss = Counter({("forward", AR, B * T): 3})
    return {"layer": layer, "embedding": embedding, "final norm + head": head, "loss": loss,
            "optimizer step": optimizer}  # fmt: skip


def summarize(events: list[dict], block_names: list[str]) -> tuple[list[Counter], dict[str, Counter]]:
    """Signature counts of each layer, and of each other category."""
    per_layer: list[Counter] = [Counter() for _ in block_names]
    per_category: dict[str, Counter] = {c: Counter() for c in CATEGORIES}
    for event in events:
        category, layer = categorize(event, block_names)
        signature = (event["phase"], event["kind"], event["elements"])
        if layer is not None:
            per_layer[layer][signature] += 1
        else:
            per_category[category][signature] += 1
    return per_layer, per_category


def _bytes(counts: Counter, itemsize: int = 4) -> int:
    return sum(n * elements * itemsize for (_, _, elements), n in counts.items())


def _wire(counts: Counter, itemsize: int = 4) -> float:
    """Bytes each rank sends with ring algorithms: 2(p-1)/p x N for an all-reduce, (p-1)/p x N otherwise."""
    share = (TP - 1) / TP
    return sum(
        n * elements * itemsize * share * (2 if kind == AR else 1)
        for (_, kind, elements), n in counts.items()
    )


def _describe(counts: Counter, phases: bool = False) -> str:
    if not counts:
        return "-"
    short = {"forward": "fw ", "backward": "bw ", "optimizer": ""}
    parts = [f"{short[phase] if phases else ''}{n}x {kind} {elements}"
             for (phase, kind, elements), n in sorted(counts.items(), key=str)]  # fmt: skip
    return f"{', '.join(parts)} ({_bytes(counts):,} B)"


def _verdict(got: Counter, want: Counter) -> str:
    if got == want:
        return "equal"
    count = sum(got.values()) - sum(want.values())
    return f"{count:+d} calls, {_bytes(got) - _bytes(want):+,} B, {_wire(got) - _wire(want):+,.0f} wire B"


def report(result: dict[str, Any]) -> str:
    """The table: measured vs Megatron minimum per layer and phase, and per other category."""
    sp, clip = result["sequence_parallel"], result["clip"]
    per_layer, per_category = summarize(result["events"], result["block_names"])
    minimum = megatron_minimum(sp, clip)
    rows = []
    for index, counts in enumerate(per_layer):
        for phase in ("forward", "backward"):
            got = Counter({k: v for k, v in counts.items() if k[0] == phase})
            want = Counter({k: v for k, v in minimum["layer"].items() if k[0] == phase})
            rows.append([f"layer {index}", phase, _describe(got), _describe(want), _verdict(got, want)])
    for category in CATEGORIES[1:]:
        got, want = per_category[category], minimum.get(category, Counter())
        if got or want:
            rows.append([category, "all", _describe(got, True), _describe(want, True), _verdict(got, want)])
    total_got = sum(per_category.values(), Counter()) + sum(per_layer, Counter())
    total_want = sum(minimum.values(), Counter()) + Counter(
        {k: v * (len(per_layer) - 1) for k, v in minimum["layer"].items()}
    )
    rows.append(
        [
            "total",
            "step",
            f"{sum(total_got.values())} calls ({_bytes(total_got):,} B)",
            f"{sum(total_want.values())} calls ({_bytes(total_want):,} B)",
            _verdict(total_got, total_want),
        ]
    )
    title = (f"tp={TP}, sequence_parallel={sp}, loss_parallel={result.get('loss_parallel', False)},"
             f" gradient_clip_val={'1.0' if clip else 'None'}")  # fmt: skip
    return f"{title}\n" + table(["category", "phase", "measured", "Megatron minimum", "difference"], rows)


# ---- the measurement ----------------------------------------------------------------------


Config = tuple[bool, bool, bool]  # (sequence_parallel, gradient clipping, loss_parallel)
WITHOUT_CLIP: tuple[Config, ...] = ((False, False, False), (True, False, False))
LOSS_PARALLEL: tuple[Config, ...] = ((False, False, True), (True, False, True))
WITH_CLIP: tuple[Config, ...] = ((False, True, False), (True, True, False))


def _measure(sp: bool, clip: bool, loss_parallel: bool) -> dict[str, Any]:
    import lightning as L

    from lightning_parallel import HybridParallelStrategy

    L.seed_everything(0, verbose=False)
    model = recipe_model(**SHAPE)
    counter = CollectiveCounter(step=1)
    strategy = HybridParallelStrategy(
        tensor_parallel=TP, sequence_parallel=sp, loss_parallel=loss_parallel, timeout=120
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=TP, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[counter], gradient_clip_val=1.0 if clip else None,
    )  # fmt: skip
    trainer.fit(model, datamodule=recipe_data(SHAPE["block_size"], BATCH, random_tokens=4096))
    return {"sequence_parallel": sp, "clip": clip, "loss_parallel": loss_parallel,
            "block_names": list(trainer.strategy.plan.block_names), "events": [asdict(e) for e in counter.events]}  # fmt: skip


def worker(out: Path, configs: tuple[Config, ...]) -> None:

    quiet_lightning()
    torch.set_num_threads(1)
    dist_env = launch_env()
    rank = init_process_group()
    results = []
    for config in configs:
        os.environ.update(dist_env)  # Lightning's environment deletes WORLD_SIZE at teardown
        results.append(_measure(*config))
    if rank == 0:
        (out / "collectives.json").write_text(json.dumps(results))
    finish_worker()


def measure(configs: tuple[Config, ...] = WITHOUT_CLIP, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Launch 2 ranks (one launch), record one step of each config; rank 0's results, in order."""
    flags = ",".join("".join(str(int(flag)) for flag in config) for config in configs)
    out = launch(
        "benchmarks.tp_collectives", ["--worker", "--configs", flags], nprocs=TP, timeout_s=timeout_s
    )
    return json.loads((out / "collectives.json").read_text())


def _print(results: list[dict[str, Any]], events: bool) -> None:
    for result in results:
        print(report(result) + "\n")
        if events:
            for e in result["events"]:
                print(f"  {e['phase']:9} {e['kind']:15} {e['elements']:>7}  {e['where']:30} {e['source']}")
            print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", action="store_true", help="also list every collective, in order")
    parser.add_argument("--no-clip", action="store_true", help="skip the runs with gradient_clip_val=1.0")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--configs", default="000", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.out, tuple(tuple(flag == "1" for flag in c) for c in args.configs.split(",")))  # type: ignore[misc]
        return
    B, T, H, V = BATCH, SHAPE["block_size"], SHAPE["n_embd"], SHAPE["vocab_size"]
    print(f"# {machine()}")
    print(f"# recipe GPT {SHAPE}, batch {B}: B*T*H={B * T * H}, B*T*V={B * T * V}, B*T={B * T}, H={H};"
          " fp32; B = tensor bytes (elements x 4); wire B = bytes sent per rank by ring algorithms;"
          " one training step on rank 0 after one warm-up step\n")  # fmt: skip
    _print(measure(WITHOUT_CLIP + LOSS_PARALLEL), args.events)
    if not args.no_clip:
        # A separate launch: gradient clipping under tensor parallelism may fail, which must not
        # hide the results above.
        try:
            _print(measure(WITH_CLIP), args.events)
        except RuntimeError as error:
            lines = [line for line in str(error).splitlines() if "Error" in line]
            print(f"gradient_clip_val=1.0 runs FAILED: {lines[-1].strip() if lines else error}")


if __name__ == "__main__":
    main()
