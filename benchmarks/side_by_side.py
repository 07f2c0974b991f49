"""Each parallel axis against what a user would write instead, side by side in one run.

    python -m benchmarks.side_by_side                      # every pair, 2 CPU ranks over gloo (< 10 min)
    python -m benchmarks.side_by_side --pairs tp dp        # some of them
    python -m benchmarks.side_by_side --quick              # the smallest settings (the smoke test's)
    python -m benchmarks.side_by_side --readme             # also rewrite the table in benchmarks/README.md

Pairs (reference -> ours), same model, weights, batches and ranks in both:

- ``tp``: Lightning's ``ModelParallelStrategy`` with ``parallelize_module`` and a plan written by hand
  for the recipe GPT (q|k|v and fc column-wise, the projections row-wise, the heads per rank set on
  the attention modules, embeddings and head replicated) -> ``HybridParallelStrategy(tensor_parallel=2)``
  with its automatic plan (which also shards the embedding and the head over the vocabulary);
  ``tp_same_plan``: ours given ``plan=`` the hand plan's modules only, the sharding decisions equal; ``tp_sp``: the same with sequence parallelism on both sides (torchtitan's pattern by
  hand: ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering the sequence into the attention and the
  MLP, their output projections reduce-scattering it). Target: step at most 1.02x, setup at most 1.2x:
  judged from ``fit`` to the end of the first step, because the one-time warm-up of DTensor's sharding
  propagation (each operator's first dispatch) happens inside the hand plan's first step and inside our
  plan's verification, on the same shapes; the time to the start of the first step is printed too.
- ``pp``: the same two (or, interleaved, four) stages of the recipe GPT cut by hand and driven with torch's
  ``PipelineStage`` and schedule classes from a manual-optimization ``training_step`` under Lightning's
  ``ModelParallelStrategy`` (``benchmarks/hand_pipeline.py``: the tied embedding and head summed over the
  two ranks, the loss sent to rank 0 and logged, as a user must) -> ``HybridParallelStrategy(pipeline_parallel=2,
  micro_batches=M)``, for 1F1B and interleaved 1F1B at M = 4, 8, 16. Target: at most 1.05x.
- ``dp``: ``strategy="ddp"`` -> ``HybridParallelStrategy()`` (target at most 1.0x), and FSDP2 (``fully_shard``
  per block and the model, in the module's ``configure_model`` under ``ModelParallelStrategy``: Lightning's
  ``strategy="fsdp"`` refuses CPUs) (reported).
- ``ep``: the MoE recipe in data parallelism only -> ``expert_parallel=2`` (reported).
- ``ac``: ``checkpoint_wrapper`` around every block written into the module (full; selective with
  torch's ``create_selective_checkpoint_contexts`` keeping the matmul and attention outputs), under
  the same strategy -> ``activation_checkpointing="full"`` / ``"selective"``. Target: at most 1.02x.

How: one launch of 2 ranks runs every pair; the two configurations of a pair run in two threads of
each rank, their training steps interleaved one by one (``common.Baton``), ``--rounds`` times with
the order alternating; pipeline steps are timed between barriers over both ranks. Printed per pair:
median step times, the ratio (median of back-to-back step pairs, with its quartiles), the time from
``fit`` to the first step, and how far the resident memory of
rank 0 rose during a short run of each configuration alone (``VmHWM`` reset before the run, minus the
resident memory at its start; each configuration ran once before, to warm the allocator). On two
shared CPU cores ratios within about 0.05 of 1 are noise; the GPU check runs the pairs that fit one
device at scale.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    Baton,
    StepTimerBase,
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

SHAPES = {
    "quick": dict(n_layer=4, n_head=2, n_embd=32, block_size=16, batch_size=4, micro_batch_size=1),
    "default": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=8, micro_batch_size=2),
    # GPT-1.3B (GPT-2 XL-like), for the one-device pairs on a GPU (scripts/gpu_check.sh)
    "large": dict(n_layer=24, n_head=16, n_embd=2048, block_size=1024, batch_size=4, micro_batch_size=1),
}
ONE_DEVICE = ("ac",)  # the groups whose pairs run on one device
# Where the configurations run: set once per process (the launcher's arguments).
DEVICE: dict[str, Any] = {"accelerator": "cpu", "devices": 2, "precision": "32-true"}
README = Path(__file__).resolve().parent / "README.md"
MARK_BEGIN, MARK_END = "<!-- side_by_side: begin -->", "<!-- side_by_side: end -->"


@dataclass(frozen=True)
class Pair:
    reference: str
    candidate: str
    target: float | None  # step-time ratio candidate / reference; None: reported only
    setup_target: float | None = None


def _pairs(micro_batches: tuple[int, ...]) -> dict[str, Pair]:
    pairs = {
        "tp": Pair("ModelParallelStrategy + hand plan", "tensor_parallel=2", 1.02, 1.2),
        "tp_same_plan": Pair(
            "ModelParallelStrategy + hand plan", "tensor_parallel=2, plan= the hand plan's modules", 1.02, 1.2
        ),
        "tp_sp": Pair(
            "ModelParallelStrategy + hand plan, sp", "tensor_parallel=2, sequence_parallel", 1.02, 1.2
        ),
        "dp_ddp": Pair("strategy='ddp'", "HybridParallelStrategy()", 1.0),
        "dp_fsdp": Pair("ModelParallelStrategy + fully_shard", "HybridParallelStrategy()", None),
        "ep": Pair("MoE, data parallel only", "expert_parallel=2", None),
        "ac_full": Pair("checkpoint_wrapper (full)", "activation_checkpointing='full'", 1.02),
        "ac_selective": Pair("checkpoint_wrapper (selective)", "activation_checkpointing='selective'", 1.02),
    }
    for schedule in ("1f1b", "interleaved_1f1b"):
        for m in micro_batches:
            pairs[f"pp_{schedule}_m{m}"] = Pair(f"PipelineStage + {schedule} by hand, M={m}",
                                                f"pipeline_parallel=2, M={m}", 1.05)  # fmt: skip
    return pairs


GROUPS = {
    "tp": ("tp", "tp_same_plan", "tp_sp"),
    "dp": ("dp_ddp", "dp_fsdp"),
    "ep": ("ep",),
    "ac": ("ac_full", "ac_selective"),
    "pp": (),
}


# ---- timing -------------------------------------------------------------------------------------


class _Clock(StepTimerBase):
    """``StepTimerBase`` (steps after ``warmup``) plus the time from its creation to the first step, passing
    ``baton`` on before every step; with ``barrier`` each step is timed between barriers over every rank
    (pipelines, whose step is the whole pipeline's)."""

    def __init__(self, baton: Baton | None, name: str, warmup: int, barrier: bool) -> None:
        super().__init__(warmup)
        self.baton, self.name, self.barrier = baton, name, barrier
        self.created = time.perf_counter()
        self.setup: list[float] = []  # fit -> the first step starts
        self.first_step: list[float] = []  # fit -> the first step ends (its one-time warm-ups included)
        self.cpu: list[float] = []  # CPU seconds of this process during each timed step (waits excluded)
        self._cpu_start = 0.0

    def _barrier(self) -> None:
        if self.barrier:
            import torch.distributed as dist

            dist.barrier()

    def begin(self) -> None:
        if not self.setup:
            self.setup.append(time.perf_counter() - self.created)
        if self.baton is not None:
            self.baton.pass_on(self.name)
        self._barrier()
        self._begin(_device())
        self._cpu_start = time.process_time()

    def end(self) -> None:
        cpu = time.process_time() - self._cpu_start
        self._barrier()
        self._end(_device())
        if self._seen > self.warmup:
            self.cpu.append(cpu)
        if not self.first_step:
            self.first_step.append(time.perf_counter() - self.created)

    @property
    def timings(self) -> Timings:
        return {**self.result(), "setup": self.setup, "first_step": self.first_step, "cpu": self.cpu}

    def callback(self) -> Any:
        from lightning.pytorch.callbacks import Callback

        clock = self

        class _Callback(Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                clock.begin()

            def on_train_batch_end(self, *args: Any) -> None:
                clock.end()

        return _Callback()


def _device() -> torch.device | None:
    """The device whose queue a step's timing waits for (None on the CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE["accelerator"] == "cuda" else None


# ---- the configurations ---------------------------------------------------------------------------


def _gpt(shape: dict[str, Any]) -> Any:
    return recipe_model(
        seed=1234, **{k: v for k, v in shape.items() if k not in ("batch_size", "micro_batch_size")}
    )


# ``plan=`` naming the modules the hand plan shards, and nothing else (the embedding and head stay whole): the
# strategy's own machinery against the hand plan's, the sharding decisions equal.
HAND_PLAN = {
    "model.transformer.h.*.attn.qkv": "fused_qkv",
    "model.transformer.h.*.attn.proj": "rowwise",
    "model.transformer.h.*.mlp.fc": "colwise",
    "model.transformer.h.*.mlp.proj": "rowwise",
}


def _hand_tp_model(shape: dict[str, Any], sequence_parallel: bool = False) -> Any:
    """The recipe GPT with the ``configure_model`` a Lightning user writes for ``ModelParallelStrategy``.

    The fused q|k|v projection is cut column-wise as it stands (contiguous rows): the same work and
    communication as a correct cut, which must first reorder the rows so that each rank gets its heads'
    q, k and v; the benchmark times steps, it does not compare what they learn. With
    ``sequence_parallel``, torchtitan's pattern: the residual stream holds each rank's part of the sequence,
    the norms run on it, the attention and the MLP gather it and reduce-scatter their output.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = _gpt(shape)

    def configure_model() -> None:
        mesh = model.device_mesh["tensor_parallel"]
        gpt = model.model
        if sequence_parallel:
            gather = {
                "input_layouts": (Shard(1),),
                "desired_input_layouts": (Replicate(),),
                "use_local_output": True,
            }
            plan = {"ln_1": SequenceParallel(), "attn": PrepareModuleInput(**gather), "attn.qkv": ColwiseParallel(),
                    "attn.proj": RowwiseParallel(output_layouts=Shard(1)), "ln_2": SequenceParallel(),
                    "mlp": PrepareModuleInput(**gather), "mlp.fc": ColwiseParallel(),
                    "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}  # fmt: skip
        else:
            plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                    "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}  # fmt: skip
        for block in gpt.transformer.h:
            parallelize_module(block, mesh, plan)
            # a user's plan must also tell the attention its heads per rank (torchtitan does the same)
            block.attn.n_head //= mesh.size()
            block.attn.n_embd //= mesh.size()
        if sequence_parallel:  # the stream enters the blocks cut along the sequence and leaves them whole
            split = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
            parallelize_module(gpt.transformer.h[0], mesh, split)
            parallelize_module(gpt.transformer.ln_f, mesh, SequenceParallel())
            parallelize_module(gpt.lm_head, mesh, PrepareModuleInput(**gather))

    model.configure_model = configure_model
    return model


def _fsdp_model(shape: dict[str, Any]) -> Any:
    """The recipe GPT with the ``configure_model`` a Lightning user writes for FSDP2 under ``ModelParallelStrategy``."""
    from torch.distributed.fsdp import fully_shard

    model = _gpt(shape)

    def configure_model() -> None:
        mesh = model.device_mesh["data_parallel"]
        for block in model.model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model.model, mesh=mesh)

    model.configure_model = configure_model
    return model


def _wrapped_model(shape: dict[str, Any], selective: bool) -> Any:
    """The recipe GPT with torch's ``checkpoint_wrapper`` written around each block (what a user writes)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    model = _gpt(shape)
    kwargs: dict[str, Any] = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if selective:
        aten = torch.ops.aten
        keep = [aten.mm.default, aten.addmm.default, aten.bmm.default,
                aten._scaled_dot_product_efficient_attention.default,
                aten._scaled_dot_product_flash_attention.default,
                aten._scaled_dot_product_flash_attention_for_cpu.default]  # fmt: skip
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, keep)
    blocks = model.model.transformer.h
    for index, block in enumerate(blocks):
        blocks[index] = checkpoint_wrapper(block, **kwargs)
    return model


def _moe(shape: dict[str, Any]) -> Any:
    from recipes.moe.module import MoEGPTLightningModule

    torch.manual_seed(1234)
    dims = {k: v for k, v in shape.items() if k in ("n_layer", "n_head", "n_embd", "block_size")}
    return MoEGPTLightningModule(vocab_size=256, num_experts=4, top_k=2, dropout=0.0, warmup_steps=1,
                                 lr_decay_steps=1000, **dims)  # fmt: skip


def _lightning_config(
    pair: str, side: str, shape: dict[str, Any], micro_batches: int
) -> tuple[Any, Any, int]:
    """(model, strategy, batch size) of one side of a Lightning pair."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_parallel import HybridParallelStrategy

    batch = shape["batch_size"]
    ours = side == "candidate"
    if pair in ("tp", "tp_same_plan", "tp_sp"):
        sp = pair == "tp_sp"
        if ours:
            plan = HAND_PLAN if pair == "tp_same_plan" else "auto"
            strategy = HybridParallelStrategy(tensor_parallel=2, sequence_parallel=sp, plan=plan, timeout=300)
            return _gpt(shape), strategy, batch
        return (
            _hand_tp_model(shape, sequence_parallel=sp),
            ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
            batch,
        )
    if pair == "dp_ddp":
        return _gpt(shape), HybridParallelStrategy(timeout=300) if ours else "ddp", batch
    if pair == "dp_fsdp":
        if ours:
            return _gpt(shape), HybridParallelStrategy(timeout=300), batch
        return _fsdp_model(shape), ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), batch
    if pair == "ep":
        return _moe(shape), HybridParallelStrategy(expert_parallel=2 if ours else 1, timeout=300), batch
    if pair.startswith("ac_"):
        mode = pair.removeprefix("ac_")
        if ours:
            return _gpt(shape), HybridParallelStrategy(activation_checkpointing=mode, timeout=300), batch
        return (
            _wrapped_model(shape, selective=mode == "selective"),
            HybridParallelStrategy(timeout=300),
            batch,
        )
    schedule = pair.split("_m")[0].removeprefix("pp_")
    batch = micro_batches * shape["micro_batch_size"]
    if not ours:  # stages cut by hand, torch's schedule driven from the step (benchmarks/hand_pipeline.py)
        from benchmarks.hand_pipeline import hand_pipeline_model

        dims = {k: v for k, v in shape.items() if k not in ("batch_size", "micro_batch_size")}
        return (
            hand_pipeline_model(schedule, micro_batches, seed=1234, **dims),
            ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
            batch,
        )
    strategy = HybridParallelStrategy(pipeline_parallel=2, micro_batches=micro_batches, pipeline_schedule=schedule,
                                      timeout=300)  # fmt: skip
    return _gpt(shape), strategy, batch


def _fit(
    model: Any, strategy: Any, batch: int, shape: dict[str, Any], data: Any, steps: int, clock: _Clock
) -> None:
    import lightning as L

    trainer = L.Trainer(
        accelerator=DEVICE["accelerator"], devices=DEVICE["devices"], precision=DEVICE["precision"], strategy=strategy,
        max_steps=steps, logger=False, callbacks=[clock.callback()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=recipe_data(shape["block_size"], batch, like=data))


# ---- one rank ------------------------------------------------------------------------------------


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_rss_mb(run: Callable[[], None]) -> float:
    """How far this process's resident memory rose above its level at the start of ``run`` (the peak,
    ``VmHWM``, reset before it; Linux). What the process already held stays out: earlier pairs leave
    memory the allocator keeps. On a GPU: the allocator's peak during ``run`` instead."""
    if DEVICE["accelerator"] == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run()
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        Path("/proc/self/clear_refs").write_text("5")
        start = _rss_kb("VmRSS")
    except (OSError, KeyError):
        return float("nan")
    run()
    return (_rss_kb("VmHWM") - start) / 1024


def _side_runner(pair: str, side: str, shape: dict[str, Any], data: Any, args: argparse.Namespace,
                 dist_env: dict[str, str]) -> Callable[[Baton | None, str, int], Timings]:  # fmt: skip
    micro_batches = int(pair.split("_m")[1]) if pair.startswith("pp_") else 0

    def run(baton: Baton | None, name: str, steps: int) -> Timings:
        os.environ.update(dist_env)  # Lightning's environment deletes WORLD_SIZE at teardown
        clock = _Clock(baton, name, args.warmup, barrier=pair.startswith("pp_"))
        model, strategy, batch = _lightning_config(pair, side, shape, micro_batches)
        _fit(model, strategy, batch, shape, data, steps, clock)
        return clock.timings

    return run


def _timed(side: Callable[[Baton | None, str, int], Timings], steps: int, baton: Baton, name: str) -> Timings:
    return side(baton, name, steps)


def worker(args: argparse.Namespace) -> None:

    quiet_lightning()
    if args.accelerator == "cpu":  # one core per rank; a GPU rank keeps its threads for the host work
        torch.set_num_threads(1)
    DEVICE.update(accelerator=args.accelerator, devices=args.devices, precision=args.precision)
    dist_env = launch_env()
    rank = init_process_group(timeout_s=600)
    shape = SHAPES[args.shape]
    data = recipe_data(shape["block_size"], shape["batch_size"])
    data.setup("fit")
    results: dict[str, Any] = {}
    for pair in args.pairs:
        sides = {
            side: _side_runner(pair, side, shape, data, args, dist_env) for side in ("reference", "candidate")
        }
        steps = args.steps + args.warmup
        rounds = []
        for index in range(args.rounds):
            order = ("reference", "candidate") if index % 2 == 0 else ("candidate", "reference")
            rounds.append(run_lockstep({s: functools.partial(_timed, sides[s], steps) for s in order}))
        for side in ("reference", "candidate") if args.accelerator == "cpu" else ():
            sides[side](None, side, 3)  # once each first: allocator caches warmed (a GPU's peak needs none)
        memory = {
            s: _peak_rss_mb(functools.partial(sides[s], None, s, 3)) for s in ("reference", "candidate")
        }
        _sum_cpu_over_ranks(rounds)
        results[pair] = {"rounds": rounds, "peak_rss_mb": memory}
        if rank == 0:
            c = compare(rounds, "reference", "candidate")
            print(f"{pair}: ratio {c['ratio']:.3f} ({c['q1']:.3f}-{c['q3']:.3f})", flush=True)
    if rank == 0:
        (args.out / "side_by_side.json").write_text(json.dumps(results))
    finish_worker()


def _sum_cpu_over_ranks(rounds: list[dict[str, Timings]]) -> None:
    """Each step's CPU seconds summed over the ranks (in place): the work a configuration did, whatever
    the wall clock (a rank waiting in a collective is blocked, not spinning, so waits add almost nothing)."""
    import torch.distributed as dist

    mine = [{side: r[side]["cpu"] for side in r} for r in rounds]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for index, measured in enumerate(rounds):
        for side in measured:
            measured[side]["cpu"] = [
                sum(steps) for steps in zip(*(e[index][side] for e in every), strict=True)
            ]


def ratios(results: dict[str, Any]) -> dict[str, float]:
    """Per pair, the paired step-time ratio ours / reference (what ``--json`` writes for the GPU check)."""
    return {name: compare(m["rounds"], "reference", "candidate")["ratio"] for name, m in results.items()}


# ---- report --------------------------------------------------------------------------------------


def _verdict(value: float, target: float | None) -> str:
    if target is None:
        return "reported"
    return f"<= {target}: {'met' if value <= target else 'MISSED'}"


def report(results: dict[str, Any], pairs: dict[str, Pair], header: str) -> str:
    rows = []
    for name, measured in results.items():
        pair = pairs[name]
        c = compare(measured["rounds"], "reference", "candidate")
        work = compare(measured["rounds"], "reference", "candidate", part="cpu")
        setups, firsts = (
            {
                s: statistics.median([r[s][key][0] for r in measured["rounds"]])
                for s in ("reference", "candidate")
            }
            for key in ("setup", "first_step")
        )
        setup_ratio = setups["candidate"] / setups["reference"]
        first_ratio = firsts["candidate"] / firsts["reference"]
        memory = measured["peak_rss_mb"]
        rows.append([
            name, pair.reference, pair.candidate, f"{c['reference_s'] * 1e3:.1f}", f"{c['candidate_s'] * 1e3:.1f}",
            f"{c['ratio']:.3f} ({c['q1']:.2f}-{c['q3']:.2f})", _verdict(c["ratio"], pair.target),
            f"{work['ratio']:.3f} ({work['q1']:.2f}-{work['q3']:.2f})",
            f"{setups['reference']:.2f} / {setups['candidate']:.2f} s = {setup_ratio:.2f}",
            f"{firsts['reference']:.2f} / {firsts['candidate']:.2f} s = {first_ratio:.2f}"
            + (f" ({_verdict(first_ratio, pair.setup_target)})" if pair.setup_target else ""),
            f"{memory['reference']:.0f} / {memory['candidate']:.0f}",
        ])  # fmt: skip
    body = table(["pair", "reference", "ours", "ref. step ms", "our step ms", "ratio (quartiles)", "target",
                  "CPU work ratio (quartiles)",
                  "fit to first step start, ref. / ours",
                  "fit to first step end, ref. / ours", "RSS rise MB rank 0, ref. / ours"], rows)  # fmt: skip
    return f"{header}\n\n{body}\n"


def _write_readme(text: str) -> None:
    readme = README.read_text()
    block = f"{MARK_BEGIN}\n{text}{MARK_END}"
    if MARK_BEGIN in readme:
        start, end = readme.index(MARK_BEGIN), readme.index(MARK_END) + len(MARK_END)
        readme = readme[:start] + block + readme[end:]
    else:
        readme += f"\n## Side by side: each axis against what a user would write instead\n\n{block}\n"
    README.write_text(readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", choices=sorted(GROUPS), default=sorted(GROUPS))
    parser.add_argument(
        "--quick", action="store_true", help="the smallest settings (seconds, numbers meaningless)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--readme", action="store_true", help="rewrite the table in benchmarks/README.md")
    parser.add_argument("--devices", type=int, choices=(1, 2), default=2, help="1: the one-device pairs (ac)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", default=None, help="default: 32-true on CPU, bf16-mixed on a GPU")
    parser.add_argument("--json", type=Path, help="also write the ratios and results there")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pairs-expanded", nargs="+", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.precision = args.precision or ("bf16-mixed" if args.accelerator == "cuda" else "32-true")
    if args.worker:
        args.pairs = args.pairs_expanded
        worker(args)
        return
    if args.devices == 1 and set(args.pairs) - set(ONE_DEVICE):
        raise ValueError(
            f"`--devices 1` runs only the one-device pairs {ONE_DEVICE}; got `--pairs {' '.join(args.pairs)}`."
        )
    if args.quick:
        args.shape, args.rounds, args.steps, args.warmup, args.micro_batches = "quick", 1, 2, 1, [4]
    results, pairs, header = measure(args.pairs, args.shape, args.rounds, args.steps, args.warmup,
                                     tuple(args.micro_batches), devices=args.devices, accelerator=args.accelerator,
                                     precision=args.precision)  # fmt: skip
    text = report(results, pairs, header)
    print(text)
    if args.readme:
        _write_readme(text)
    if args.json:
        args.json.write_text(json.dumps({"ratios": ratios(results), "results": results, "header": header}))


def measure(
    groups: list[str], shape: str, rounds: int, steps: int, warmup: int, micro_batches: tuple[int, ...],
    timeout_s: float = 1800, devices: int = 2, accelerator: str = "cpu", precision: str = "32-true",
) -> tuple[dict[str, Any], dict[str, Pair], str]:  # fmt: skip
    """Run the pairs of ``groups`` in one launch of ``devices`` ranks: (measured per pair, the pairs, a header)."""
    pairs = _pairs(micro_batches)
    selected = [p for group in groups for p in (GROUPS[group] or [k for k in pairs if k.startswith("pp_")])]
    forwarded = ["--worker", "--shape", shape, "--rounds", str(rounds), "--steps", str(steps),
                 "--warmup", str(warmup), "--micro-batches", *map(str, micro_batches),
                 "--pairs-expanded", *selected, "--devices", str(devices), "--accelerator", accelerator,
                 "--precision", precision]  # fmt: skip
    start = time.perf_counter()
    out = launch("benchmarks.side_by_side", forwarded, nprocs=devices, timeout_s=timeout_s)
    results = json.loads((out / "side_by_side.json").read_text())
    header = (f"# {machine()}; {devices} rank(s), {accelerator}, {precision}, gloo; recipe GPT {SHAPES[shape]}; {rounds} rounds"
              f" x {steps} timed steps (+{warmup} warm-up) per side, steps interleaved;"
              f" {time.perf_counter() - start:.0f} s")  # fmt: skip
    return results, pairs, header


if __name__ == "__main__":
    main()
