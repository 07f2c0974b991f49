"""The GPU check for a lent H100 or H200, in one command that ends before its deadline: ``bash scripts/gpu_check.sh``.

    PYTHONPATH=. python -m benchmarks.gpu_check --out DIR                # the lent GPU: at most 9 minutes
    PYTHONPATH=. python -m benchmarks.gpu_check --quick --out DIR        # the most valuable phases, 5 minutes
    PYTHONPATH=. python -m benchmarks.gpu_check --dry-run --out DIR      # the same logic on a CPU, tiny shapes

The lent machine gives a session 15 minutes of device time in all and at most 10 minutes a
command, with its own Python 3.12, torch 2.11 and Lightning 2.6.6 (deepspeed and torchao carried as
wheels, no network), so this runs the most valuable measurements first, each a subprocess with a
time limit cut to what is left of the deadline (``--deadline-s``, 540 s by default), and stops
cleanly when time runs out: a phase that would not fit is skipped, one that overruns is stopped, and
what was measured is kept. Every figure is judged against plain PyTorch on the same model and
batches (or a peer a user would pick), never one of our paths against another of ours alone.
DeepSpeed's CPU Adam compiles on first use (about a minute there): it is built in the background
from the start, and the offload phases wait for it outside their timed steps.

1. ``environment``: torch, CUDA, the device, the project imports.
2. ``engines_deepspeed``: GPT-1.3B bf16-mixed, eager vs the strategy at degrees 1 and DeepSpeed's ZeRO-1,
   -2 and -3 (``benchmarks/zero_engines.py``): step time / eager (<= 1.05x), peak memory / the planner's
   prediction (within 10%), the share of Linear outputs computed in bf16 (must be 1).
3. ``offload``: the same for ZeRO-2 + CPU offload and ZeRO-3 with parameters offloaded (<= 2x eager).
4. ``memory``: the memory savers on GPT-1.3B, selective and full recomputation against no recomputation
   (``benchmarks/memory_savers.py``), the planner's step time and memory beside them.
5. ``engines_fsdp2``: FSDP2 ZeRO-2 and -3 (``zero_engine="fsdp2"``), and ZeRO-3 gathering bf16 copies
   (``zero_gather_dtype="compute"``), the same figures as 2.
6. ``precisions``: 32-true, bf16-mixed and 16-mixed with loss scaling through the Trainer on an nccl
   process group against plain PyTorch (``benchmarks/gpu_paths.py``).
6b. ``moe_autocast``: a Hugging Face Qwen3-MoE under bf16 autocast, torch alone against the precision plugins'
   rule for grouped matmuls (``benchmarks/moe_autocast.py``): the experts' dtype and the step time.
6c. ``ring_kernels``: context parallelism's ring blocks on one device, torch's CUDA flash kernel or the fp32
   math, against ``F.scaled_dot_product_attention`` (``benchmarks/ring_kernels.py``).
7. ``largest``: the largest GPT that trains with ZeRO-3 + CPU offload (``benchmarks/zero_offload.py``).
8. ``fp8``: a few steps with ``Float8Precision`` against bf16-mixed (where the GPU has fp8).
9. ``long_context``: the longest sequence a 1.3B model trains on the one device with full checkpointing.
10. ``compile``: ``torch.compile`` of the eager step, and the strategy's compiled step with full recomputation.
11. ``side_by_side``: full and selective recomputation against torch's ``checkpoint_wrapper``.
12. ``step``: eager vs Lightning vs the strategy (``benchmarks/gpu_step.py``), only with ``--only step``.

The chip is read in phase 1: a call that names no kind is lent an H100 (about 78 GiB), one that
names ``nvidia-h200`` an H200 (about 139 GiB). Every phase fits either (the largest step, eager
GPT-1.3B, peaked at 53.6 GiB on the H200). The planner's figures use the chip's preset; the
reference figures measured on the H200 (``ANCHORS.md``, the run of 2026-12-04) are judged on an
H200 and shown beside the measurement ("reported") on another chip; every ratio against eager is
judged on both.

``--quick`` runs 1-4. Writes ``gpu_check.json`` (every phase's status and seconds of device time, its
results, and each figure against its target) and ``gpu_check.txt`` (what the phases printed) into
``--out``. Exit status 0 when every phase that ran passed its own checks; a missed speed target is
reported, not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 540.0
QUICK_DEADLINE_S = 300.0
MARGIN_S = 15.0  # kept for writing the results and the process exit


@dataclass(frozen=True)
class Figure:
    """One number a phase produces, against a target (``<=``, ``>=``, ``==``) or a reference (within ``rel``)."""

    name: str
    read: Callable[[dict[str, Any]], Any]
    compare: str  # "<=", ">=", "==", "~" (a reference figure, within ``rel``), "report" (shown, not judged)
    value: Any
    source: str
    rel: float = 0.0

    def check(self, results: dict[str, Any]) -> dict[str, Any]:
        try:
            measured = self.read(results)
        except (KeyError, TypeError, ZeroDivisionError, IndexError):
            return {"figure": self.name, "measured": None, "verdict": "not measured", "source": self.source}
        if self.compare == "<=":
            ok = measured <= self.value
        elif self.compare == ">=":
            ok = measured >= self.value
        elif self.compare == "==":
            ok = measured == self.value
        elif self.compare == "report":  # a reference measured on another device: shown beside it, not judged
            return {"figure": self.name, "measured": measured, "wanted": f"~ {self.value} on {self.source}",
                    "verdict": "reported", "source": self.source}  # fmt: skip
        else:
            ok = abs(measured - self.value) <= self.rel * abs(self.value)
        wanted = f"{self.compare} {self.value}" + (f" (within {self.rel:.0%})" if self.compare == "~" else "")
        return {"figure": self.name, "measured": measured, "wanted": wanted, "verdict": "pass" if ok else "miss",
                "source": self.source}  # fmt: skip


@dataclass
class Phase:
    name: str
    args: list[str]  # ``python -m benchmarks.<...>`` arguments; ``{json}`` is this phase's results file
    limit_s: float
    figures: list[Figure] = field(default_factory=list)
    needs: str | None = None  # a module that must import on the machine, else the phase is skipped
    wait_for_ops: bool = False  # DeepSpeed's CPU Adam must be built first (in the background since the start)


def _ms(name: str) -> Callable[[dict[str, Any]], float]:
    import statistics

    return lambda r: statistics.median(r["results"][name]["times"]) * 1e3


def _ran(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda r: bool(r["results"][name]["times"]) and "error" not in r["results"][name]


def planned(shape: str = "large", cluster: str = "h200") -> dict[str, dict[str, float]]:
    from benchmarks.planner_check import predictions

    return predictions(shape, cluster)


REFERENCE_DEVICE = "h200"
"""The chip of the reference figures (``ANCHORS.md``, the run of 2026-12-04): judged only on the same chip."""


def planner_preset(device: str | None) -> str | None:
    """The planner's cluster preset of the lent chip (as torch names it), None for a chip the planner lacks.

    The tool lends an H100 (about 78 GiB) to a call that names no kind, an H200 (about 139 GiB) to one
    that names it: their compute peaks match, their memory bandwidth does not (3.35 vs 4.8 TB/s).
    """
    name = (device or "").lower()
    for chip in ("h200", "h100"):
        if chip in name:
            return chip
    return None


def planner_figures(preset: str | None) -> list[Figure]:
    """Issue 14: the planner's step time and the memory a step adds, against the measured GPT-1.3B steps."""
    from benchmarks.planner_check import ratio

    predicted = planned(cluster=preset or REFERENCE_DEVICE)
    source = f"docs/planner.md: the planner's prediction ({preset or REFERENCE_DEVICE} preset)"
    return [
        Figure(f"{config} recomputation: measured / predicted {what}", lambda r, c=config, k=key: ratio(r, predicted, c, k),
               "~" if preset else "report", 1.0, source if preset else "no planner preset for this chip", rel)
        for config in ("none", "full") for key, what, rel in (("step_s", "step time", 0.15), ("step_bytes", "step memory", 0.2))
    ]  # fmt: skip


def exact_saver_figures() -> list[Figure]:
    """Recomputation and offload change where activations live, never a gradient: on the GPU, the offload's
    copies on a side stream are proven ordered here (a copy read too early changes a gradient, not the loss)."""
    from benchmarks.memory_savers import LOSSLESS

    return [Figure(f"{name}: step-0 gradients equal none's", lambda r, n=name: r["results"][n]["gradients_match"], "==",
                   True, "benchmarks/memory_savers.py: within 10x none against itself") for name in LOSSLESS]  # fmt: skip


def reference(name: str, read: Callable[[dict[str, Any]], Any], value: float, source: str, rel: float,
              device: str | None) -> Figure:  # fmt: skip
    """A figure measured on the reference H200: judged within ``rel`` there, shown beside it on another chip."""
    same = planner_preset(device) == REFERENCE_DEVICE or device is None
    return Figure(name, read, "~" if same else "report", value, source if same else "the reference H200", rel)


QUICK = ("environment", "engines_deepspeed", "offload", "memory")
ON_REQUEST = ("step",)  # run only when named in --only


def engine_figures(group: str, dry_run: bool) -> list[Figure]:
    """Per engine of ``benchmarks.zero_engines``: step time / eager, peak / planner, bf16 share of Linear outputs."""
    from benchmarks.zero_engines import GROUPS, MEMORY_TOLERANCE, target_for

    figures = []
    for name in GROUPS[group]:
        read = lambda r, n=name, k="over_eager": r["figures"][n][k]  # noqa: E731
        figures.append(Figure(f"{name}: bf16 share of Linear outputs", lambda r, n=name: r["figures"][n]["bf16_share"],
                              "==", 1.0, "bf16-mixed computes every matmul in bf16 (issue 33)"))  # fmt: skip
        if dry_run:
            continue
        figures.append(
            Figure(f"{name} / eager step time", read, "<=", target_for(name), "benchmarks/zero_engines.py")
        )
        figures.append(Figure(f"{name}: peak memory / planner", lambda r, n=name: r["figures"][n]["peak_gib"]
                              / r["figures"][n]["predicted_gib"], "~", 1.0, "lightning_parallel.planner.rank_memory",
                              MEMORY_TOLERANCE))  # fmt: skip
        # the engines before it in the same process let go of their memory (2026-12-04: 19.6 GiB after ZeRO-1)
        figures.append(Figure(f"{name}: GiB earlier engines left allocated", lambda r, n=name: r["results"][n]["held_gib"],
                              "<=", 0.5, "zero/engine.py: release_engine"))  # fmt: skip
    return figures


def phases(dry_run: bool, device: str | None = None) -> list[Phase]:
    """The check's phases; ``device`` (the lent chip as torch names it, None before it is known) picks the
    planner's preset and whether the H200's reference figures are judged."""
    tiny_cpu = ["--tiny", "--cpu"] if dry_run else []
    readme, anchors = (
        "benchmarks/README.md",
        "reference H200 measurements (docs/design.md, benchmarks/README.md)",
    )
    return [
        Phase("environment", ["benchmarks.gpu_check", "--environment", "{json}"], 60,
              [Figure("cuda device", lambda r: r["cuda"], "==", True, "the lent machine has one")] if not dry_run else []),
        Phase("engines_deepspeed", ["benchmarks.zero_engines", "--group", "deepspeed", *tiny_cpu, "--json", "{json}"],
              150, engine_figures("deepspeed", dry_run), needs="deepspeed"),
        Phase("offload", ["benchmarks.zero_engines", "--group", "offload", *tiny_cpu, "--json", "{json}"], 220,
              engine_figures("offload", dry_run), needs="deepspeed", wait_for_ops=True),
        Phase("memory", ["benchmarks.memory_savers", *(["--tiny", "--cpu"] if dry_run else ["--large", "--rounds", "3"]),
                         "--json", "{json}"], 150, [
            reference("full checkpointing step time / none", lambda r: r["results"]["full"]["time_ratio"], 1.22, anchors,
                      0.10, device),
            Figure("selective (ops) recomputation trains", lambda r: r["results"]["selective (ops)"]["step_s"] > 0, "==",
                   True, "issue 39: crashed on torch 2.11"),
            *planner_figures(planner_preset(device) if device else REFERENCE_DEVICE),
            *exact_saver_figures(),
        ] if not dry_run else [Figure("planner predicts the tiny steps", lambda r: planned("tiny")["full"]["step_s"] > 0,
                                      "==", True, "runs"),
                               Figure("selective (ops) recomputation trains",
                                      lambda r: r["results"]["selective (ops)"]["step_s"] > 0, "==", True, "runs"),
                               *exact_saver_figures()]),
        Phase("engines_fsdp2", ["benchmarks.zero_engines", "--group", "fsdp2", *tiny_cpu, "--json", "{json}"], 150,
              engine_figures("fsdp2", dry_run)),
        Phase("precisions", ["benchmarks.gpu_paths", *tiny_cpu, "--json", "{json}"], 120, [
            Figure(f"{p} loss parity with plain PyTorch", lambda r, p=p: r["results"][p]["parity"], "==", True,
                   "benchmarks/gpu_paths.py tolerances") for p in ("32-true", "bf16-mixed", "16-mixed")
        ]),
        # Hugging Face's MoE experts (torch._grouped_mm) under bf16 autocast: torch alone vs the plugins' rule.
        Phase("moe_autocast", ["benchmarks.moe_autocast", *tiny_cpu, "--json", "{json}"], 90, [
            Figure("HF MoE experts: bf16 share of grouped products", lambda r: r["bf16_share"] if r["bf16_share"]
                   is not None else r["no grouped product ran"], "==", 1.0, "precision/grouped_mm_autocast.py"),
            *([Figure("HF MoE step: grouped rule / torch autocast alone", lambda r: r["rule_over_alone"], "<=", 1.0,
                      "bf16 grouped kernel vs torch's fp32 path")] if not dry_run else []),
        ]),
        # Context parallelism's ring blocks on one device: torch's CUDA flash kernel or the fp32 math, against SDPA.
        Phase("ring_kernels", ["benchmarks.ring_kernels", *tiny_cpu, "--json", "{json}"], 60, [
            *([Figure("context parallel ring blocks use torch's flash kernel", lambda r: r["flash_on_gpu"], "==", True,
                      "context_parallel/cuda_blocks.py")] if not dry_run else []),
            Figure("ring blocks' difference from fp32 attention / torch bf16 SDPA's", lambda r: r["blocks_vs_exact"]
                   / r["torch_bf16_vs_exact"], "<=", 2.0, "the rounding of a bf16 kernel"),
            *([Figure("ring blocks / torch SDPA over the whole sequence, time", lambda r: r["blocks_over_torch"], "<=",
                      1.0, "the blocks do 3/4 of its work")] if not dry_run else []),
        ]),
        Phase("largest", ["benchmarks.zero_offload", *(["--tiny", "--cpu"] if dry_run else ["--sizes", "2.7B,6.7B,8.3B",
                                                                                          "--limit-s", "150"]),
                          "--json", "{json}"], 240, [
            Figure("largest GPT trained with ZeRO-3 + CPU offload", lambda r: r["largest"], "==",
                   "tiny" if dry_run else "8.3B", "issue 39: at least 8B on one H200 with a 128 GB host (the"
                   " engine's ~20 B/parameter on the host: 155 GiB for 8.3B, not tried there)"),
        ], needs="deepspeed", wait_for_ops=True),
        # Float8Precision vs bf16-mixed, where the GPU has fp8; torchao (its float8 layers) is not on every machine.
        Phase("fp8", ["benchmarks.memory_savers", "--fp8"], 60, needs="torchao"),
        Phase("long_context", ["benchmarks.long_context", *(["--tiny", "--cpu"] if dry_run else ["--budget-s", "75"]),
                               "--json", "{json}"], 100, [
            Figure("longest sequence trained (1.3B, full checkpointing, cp=1)", lambda r: r["longest"], ">=", 8192,
                   "docs/context_parallel.md: the one-device baseline of context parallelism"),
        ] if not dry_run else [Figure("longest tiny sequence", lambda r: r["longest"], "==", 256, "runs")]),
        Phase("compile", ["benchmarks.gpu_step", "--compile-only", *tiny_cpu, "--json", "{json}"], 200, [
            reference("compile GPT-1.3B ms/step", _ms("compile"), 258.0, anchors, 0.10, device),
            Figure("strategy compiled with full checkpointing trains", _ran("strategy compiled, full checkpointing"),
                   "==", True, "issue 21: a compiled step with recomputation on the GPU"),
        ] if not dry_run else [Figure("strategy compiled with full checkpointing trains",
                                      _ran("strategy compiled, full checkpointing"), "==", True, "runs")]),
        # The one-device pairs of benchmarks.side_by_side at GPT-1.3B: our recomputation against checkpoint_wrapper.
        Phase("side_by_side", ["benchmarks.side_by_side", "--devices", "1", "--pairs", "ac",
                               *(["--quick"] if dry_run else ["--accelerator", "cuda", "--shape", "large", "--rounds",
                                                              "1", "--steps", "4", "--warmup", "2"]),
                               "--json", "{json}"], 200, [
            Figure(f"{mode} recomputation: ours / checkpoint_wrapper step time", lambda r, m=mode: r["ratios"][f"ac_{m}"],
                   "<=", 1.02, readme) for mode in ("full", "selective")
        ]),
        Phase("step", ["benchmarks.gpu_step", "--no-compile", *tiny_cpu, "--json", "{json}"], 200, [
            Figure("strategy / eager step time", lambda r: r["strategy_over_eager"], "<=", 1.02, readme),
            Figure("lightning / eager step time", lambda r: _ms("lightning")(r) / _ms("eager")(r), "~", 1.00, anchors, 0.03),
        ] if not dry_run else [Figure("strategy / eager step time", lambda r: r["strategy_over_eager"] > 0, "==", True, "runs")]),
    ]  # fmt: skip


def environment(path: str) -> None:
    """Phase 1, in its own process: what the machine has, and that the project imports there."""
    import lightning
    import torch

    import lightning_parallel  # noqa: F401
    import recipes.gpt.module  # noqa: F401

    info = {"torch": torch.__version__, "cuda_version": torch.version.cuda, "lightning": lightning.__version__,
            "python": sys.version.split()[0], "cuda": torch.cuda.is_available()}  # fmt: skip
    if info["cuda"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["bf16"] = torch.cuda.is_bf16_supported()
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["planner_preset"] = planner_preset(info["device"])
    print(json.dumps(info))
    Path(path).write_text(json.dumps(info))


def _build_ops(python: str, env: dict[str, str], log: Any) -> subprocess.Popen | None:
    """DeepSpeed's CPU Adam compiled in the background from the start (a minute there), or None without deepspeed."""
    if subprocess.run([python, "-c", "import deepspeed"], capture_output=True, env=env).returncode:
        return None
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam ready')"
    return subprocess.Popen([python, "-c", code], cwd=ROOT, env={**env, "MAX_JOBS": "4"}, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip


def selected(dry_run: bool, only: list[str] | None, quick: bool, device: str | None = None) -> list[Phase]:
    """The phases to run, in order: ``only`` (and the environment), else ``--quick``'s, else all but on-request ones."""
    chosen = []
    for phase in phases(dry_run, device=device):
        if phase.name == "environment":
            chosen.append(phase)
        elif only:
            if phase.name in only:
                chosen.append(phase)
        elif (not quick or phase.name in QUICK) and phase.name not in ON_REQUEST:
            chosen.append(phase)
    return chosen


def run(
    out: Path,
    deadline_s: float,
    dry_run: bool,
    only: list[str] | None = None,
    python: str = sys.executable,
    quick: bool = False,
) -> dict[str, Any]:
    start = time.monotonic()
    log = (out / "gpu_check.txt").open("w")
    report: dict[str, Any] = {"deadline_s": deadline_s, "dry_run": dry_run, "quick": quick, "phases": []}
    # The checkout first, then what the caller put on the path (wheels carried to the lent machine).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if dry_run:
        env["GPU_CHECK_DRY_RUN"] = "1"
    to_run = selected(dry_run, only, quick)
    ops = _build_ops(python, env, log) if any(p.wait_for_ops for p in to_run) else None
    judged = {phase.name: phase.figures for phase in to_run}
    for phase in to_run:
        left = deadline_s - MARGIN_S - (time.monotonic() - start)
        entry: dict[str, Any] = {"phase": phase.name, "status": "", "seconds": 0.0, "figures": []}
        report["phases"].append(entry)
        if (
            phase.needs
            and subprocess.run(
                [python, "-c", f"import {phase.needs}"], capture_output=True, env=env
            ).returncode
        ):
            entry["status"] = f"skipped: {phase.needs} is not installed"
            continue
        if phase.wait_for_ops and ops is not None and ops.poll() is None:
            waited = time.monotonic()
            try:
                ops.wait(timeout=max(left - 30.0, 1.0))
            except subprocess.TimeoutExpired:
                pass
            report["ops_wait_s"] = round(time.monotonic() - waited, 1)
            left = deadline_s - MARGIN_S - (time.monotonic() - start)
        if left < min(30.0, phase.limit_s):
            entry["status"] = "skipped: the deadline"
            continue
        results = out / f"{phase.name}.json"
        args = [a.replace("{json}", str(results)) for a in phase.args]
        limit = min(phase.limit_s, left)
        log.write(f"\n$ python -m {' '.join(args)}   (limit {limit:.0f} s)\n")
        log.flush()
        began = time.monotonic()
        try:
            done = subprocess.run([python, "-m", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=limit)  # fmt: skip
            entry["status"] = "passed" if done.returncode == 0 else f"failed (exit status {done.returncode})"
        except subprocess.TimeoutExpired:
            entry["status"] = f"stopped at its limit of {limit:.0f} s"
        entry["seconds"] = round(time.monotonic() - began, 1)
        if results.exists():
            entry["results"] = json.loads(results.read_text())
            entry["figures"] = [figure.check(entry["results"]) for figure in judged[phase.name]]
            if phase.name == "environment" and not dry_run:
                # The lent chip is known now: its planner preset, and whether the H200's references apply.
                report["device"] = device = entry["results"].get("device")
                judged = {p.name: p.figures for p in selected(dry_run, only, quick, device)}
        print(f"gpu_check: {phase.name}: {entry['status']} in {entry['seconds']} s", flush=True)
        for figure in entry["figures"]:
            print(
                f"gpu_check:   {figure['figure']}: {figure['measured']} {figure.get('wanted', '')} -> {figure['verdict']}"
            )
    if ops is not None:
        report["ops_build"] = "done" if ops.poll() == 0 else f"exit status {ops.poll()}"
        if ops.poll() is None:
            ops.kill()
    report["seconds"] = round(time.monotonic() - start, 1)
    report["ok"] = all(
        e["status"] in ("passed",) or e["status"].startswith("skipped") for e in report["phases"]
    )
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    log.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json and .txt"
    )
    parser.add_argument(
        "--deadline-s", type=float, default=None, help=f"{DEADLINE_S:.0f} s ({QUICK_DEADLINE_S:.0f} s quick)"
    )
    parser.add_argument("--dry-run", action="store_true", default=bool(os.environ.get("GPU_CHECK_DRY_RUN")))
    parser.add_argument(
        "--only",
        default=os.environ.get("GPU_CHECK_ONLY", ""),
        help="comma-separated phases to run (GPU_CHECK_ONLY=memory: the memory savers alone)",
    )
    parser.add_argument(
        "--quick", action="store_true", default=bool(os.environ.get("GPU_CHECK_QUICK")),
        help=f"only the most valuable phases, within 5 minutes: {', '.join(QUICK)}",
    )  # fmt: skip
    parser.add_argument("--environment", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.environment:
        environment(args.environment)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = [name for name in args.only.split(",") if name]
    deadline = args.deadline_s or (QUICK_DEADLINE_S if args.quick else DEADLINE_S)
    report = run(out, deadline, args.dry_run, only, quick=args.quick)
    print(
        f"gpu_check: {'OK' if report['ok'] else 'FAILED'} in {report['seconds']} s; {out / 'gpu_check.json'}"
    )
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
