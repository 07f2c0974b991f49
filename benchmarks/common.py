"""Shared pieces of the benchmarks: step timing, multi-process launch, the recipe model, tables.

Every benchmark measures the configurations it compares side by side in ONE run and prints
their ratio; nothing here is a timed assertion (the test-suite counts, it never times).

Multi-process benchmarks start their ranks themselves with :func:`launch` (one subprocess per
rank, with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set). Lightning then sees
processes created externally, launches nothing, and every ``Trainer`` of a rank reuses the
one gloo process group the rank opened with :func:`init_process_group`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
_STRIP_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_")

__all__ = [
    "DIST_ENV",
    "Baton",
    "LockstepTimer",
    "Timings",
    "breakdown",
    "compare",
    "finish_worker",
    "ROOT",
    "StepTimer",
    "StepTimerBase",
    "init_process_group",
    "launch",
    "machine",
    "quiet_lightning",
    "recipe_data",
    "recipe_model",
    "run_lockstep",
    "run_paired_rounds",
    "table",
    "write_json",
]


# ---- timing -------------------------------------------------------------------------------


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimerBase:
    """Wall time of each training step (forward, backward, optimizer), warm-up steps excluded."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
        self._start = 0.0
        self._marks: dict[str, float] = {}
        self._seen = 0

    def _begin(self, device: torch.device | None) -> None:
        _sync(device)
        self._start = time.perf_counter()

    def _end(self, device: torch.device | None) -> None:
        _sync(device)
        end = time.perf_counter()
        self._seen += 1
        if self._seen > self.warmup:
            self.times.append(end - self._start)
            if {"backward", "optimizer"} <= self._marks.keys():  # phase marks (CPU timers only)
                self.phases["forward"].append(self._marks["backward"] - self._start)
                self.phases["backward"].append(self._marks["optimizer"] - self._marks["backward"])
                self.phases["optimizer"].append(end - self._marks["optimizer"])
        self._marks = {}

    def result(self) -> dict[str, list[float]]:
        """Step times and, where marked, the forward / backward / optimizer-and-rest part of each."""
        return {"step": self.times, **{k: v for k, v in self.phases.items() if v}}

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def StepTimer(warmup: int = 2) -> Any:  # noqa: N802 (a factory: Lightning is imported lazily)
    """A Lightning ``Callback`` timing ``on_train_batch_start`` -> ``on_train_batch_end``."""
    from lightning.pytorch.callbacks import Callback

    class _StepTimer(StepTimerBase, Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._begin(pl_module.device)

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self._end(pl_module.device)

    return _StepTimer(warmup)


class Baton:
    """Turn-taking between threads: exactly one runs at a time, in a fixed order.

    Each thread holds the baton from its start; at every step it passes it on and waits for
    it to come back. So training steps of several configurations interleave one by one
    (A, B, A, B, ...) and whatever the machine does meanwhile (other jobs, clock changes) hits
    them alike. Everything a thread does runs while it holds the baton, so its setup and the
    work between its steps never overlap the other's timed step, and collectives happen in the
    same order on every rank.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._cond = threading.Condition()
        self._order = list(names)
        self._turn = 0
        self._done: set[str] = set()

    def wait(self, name: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._order[self._turn] == name)

    def _advance(self) -> None:
        for k in range(1, len(self._order) + 1):
            candidate = (self._turn + k) % len(self._order)
            if self._order[candidate] not in self._done:
                self._turn = candidate
                return

    def pass_on(self, name: str) -> None:
        """Give the turn to the next configuration still running, then wait for it to come back."""
        with self._cond:
            self._advance()
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._order[self._turn] == name)

    def finish(self, name: str) -> None:
        with self._cond:
            self._done.add(name)
            if self._order[self._turn] == name:
                self._advance()
            self._cond.notify_all()


def LockstepTimer(baton: Baton, name: str, warmup: int = 2) -> Any:  # noqa: N802
    """A :func:`StepTimer` that passes ``baton`` on before every step, so configurations alternate."""
    from lightning.pytorch.callbacks import Callback

    class _LockstepTimer(StepTimerBase, Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            baton.pass_on(name)
            self._begin(pl_module.device)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._marks["backward"] = time.perf_counter()

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            self._marks["optimizer"] = time.perf_counter()

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            self._end(pl_module.device)

    return _LockstepTimer(warmup)


Timings = dict[str, list[float]]  # "step" (and "forward", "backward", "optimizer") -> seconds per step


def run_lockstep(runs: dict[str, Callable[[Baton, str], Timings]]) -> dict[str, Timings]:
    """Run each ``runs[name](baton, name)`` in its own thread, steps interleaved; their timings.

    A run builds its ``Trainer`` with ``LockstepTimer(baton, name)`` and returns ``timer.result()``.
    The first exception of any run is raised here after all threads end.
    """
    baton = Baton(list(runs))
    results: dict[str, Timings] = {}
    errors: list[BaseException] = []

    def target(name: str) -> None:
        baton.wait(name)
        try:
            results[name] = runs[name](baton, name)
        except BaseException as error:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(error)
        finally:
            baton.finish(name)

    threads = [threading.Thread(target=target, args=(name,), name=f"lockstep-{name}") for name in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# ---- the recipe model and data ------------------------------------------------------------


def recipe_model(seed: int = 1234, cls: type | None = None, **kwargs: Any) -> Any:
    """``GPTLightningModule`` (or its subclass ``cls``) with the same initial weights for the same ``seed`` and
    shape."""
    from recipes.gpt.module import GPTLightningModule

    torch.manual_seed(seed)
    kwargs.setdefault("warmup_steps", 1)
    kwargs.setdefault("lr_decay_steps", 1000)
    return (cls or GPTLightningModule)(**kwargs)


def recipe_data(block_size: int, batch_size: int, random_tokens: int | None = None, like: Any = None) -> Any:
    """The recipe's ``TokenDataModule`` in fixed order (no shuffling): every configuration sees the same batches.

    ``random_tokens``: that many random byte tokens instead of the embedded corpus (decoding the
    corpus takes seconds; counting collectives needs only the shapes). ``like``: a module that is
    already set up, whose tokens the new one shares (one module per concurrently running Trainer).
    """
    import numpy as np

    from recipes.gpt.data import TokenDataModule, TokenWindows

    data = TokenDataModule(block_size=block_size, batch_size=batch_size, shuffle=False)
    if like is not None:
        like.setup("fit")
        data.train_set, data.val_set = like.train_set, like.val_set  # setup() keeps sets that exist
    elif random_tokens is not None:
        tokens = np.random.default_rng(0).integers(0, 256, random_tokens).astype(np.uint16)
        data.train_set = TokenWindows(tokens, block_size)
        data.val_set = TokenWindows(tokens[: block_size + 1], block_size)
    return data


def quiet_lightning() -> None:
    """Only errors from Lightning and the project: the benchmarks print their own lines."""
    import lightning  # noqa: F401 (its import sets its loggers to INFO: silence them after it)

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    logging.getLogger("lightning_parallel").setLevel(logging.ERROR)
    for pattern in (".*does not have many workers.*", ".*smaller than the logging interval.*",
                    ".*srun.*", ".*sequence_parallel.*no effect.*", ".*validation_step.*val_dataloader.*",
                    ".*LeafSpec.*"):  # fmt: skip
        warnings.filterwarnings("ignore", pattern)


# ---- multi-process launch -----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, args: Sequence[str], nprocs: int, timeout_s: float = 600.0, threads: int = 1) -> Path:
    """Run ``python -m module args`` as ``nprocs`` ranks; returns the folder given to them as ``--out``.

    Fails fast: the first rank that exits non-zero gets the others killed and its output raised.
    Each rank writes what it measured into ``--out``; the caller reads it from there.
    """
    out = Path(tempfile.mkdtemp(prefix="lp-bench-"))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV and not k.startswith(_STRIP_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    procs = []
    for rank in range(nprocs):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                    "LOCAL_WORLD_SIZE": str(nprocs), "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)}  # fmt: skip
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed when the process ends)
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args, "--out", str(out)], cwd=ROOT,
                                      env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        log.close()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise RuntimeError(
                    _report(out, f"rank {failed[0]} exited with status {codes[failed[0]]}", nprocs)
                )
            if all(c == 0 for c in codes):
                # read by the caller, then not needed: gone when its process ends (kept, and named, on failure)
                atexit.register(shutil.rmtree, out, ignore_errors=True)
                return out
            if time.monotonic() > deadline:
                raise RuntimeError(_report(out, f"timed out after {timeout_s:.0f} s", nprocs))
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def _report(out: Path, reason: str, nprocs: int) -> str:
    lines = [f"{reason}; output in {out}"]
    for rank in range(nprocs):
        text = (out / f"rank{rank}.log").read_bytes()[-4000:].decode(errors="replace")
        lines.append(f"===== rank {rank} =====\n{text}")
    return "\n".join(lines)


LAUNCH_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_env() -> dict[str, str]:
    """The launch's rank variables, to hand back to Lightning after the benchmark's own process group."""
    return {k: os.environ[k] for k in LAUNCH_ENV_KEYS}


def init_process_group(timeout_s: float = 120.0) -> int:
    """Open the gloo process group from the launch's environment variables; returns the rank."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip
    return rank


def finish_worker() -> None:
    """End a benchmark rank: barrier, destroy every process group, flush, and leave without finalization.

    A rank whose results are written must not fail afterwards: seen once in CI, a pipeline rank
    aborted in interpreter finalization ("terminate called without an active exception", status -6)
    after a clean run, the known race of gloo's worker threads releasing tensors once Python is
    torn down (pytorch/pytorch PR 179291). ``os._exit`` skips that finalization.
    """
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_json(path: Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=1))


# ---- reporting ----------------------------------------------------------------------------


def compare(
    rounds: Sequence[dict[str, Timings]], reference: str, candidate: str, part: str = "step"
) -> dict[str, Any]:
    """Timings of two interleaved configurations -> medians and the candidate / reference ratio.

    ``ratio``: the median over all rounds of the *paired* ratios ``candidate[i] / reference[i]``
    (step ``i`` of each ran back to back), robust to load that changes during the run.
    ``q1``/``q3``: the quartiles of those paired ratios; ``per_round``: each round's median pair.
    ``part``: ``"step"``, or one of its parts ``"forward"``, ``"backward"``, ``"optimizer"``.
    """
    pairs, per_round = [], []
    for measured in rounds:
        round_pairs = [
            c / r for r, c in zip(measured[reference][part], measured[candidate][part], strict=False)
        ]
        pairs += round_pairs
        per_round.append(statistics.median(round_pairs))
    quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    return {
        "reference_s": statistics.median([t for m in rounds for t in m[reference][part]]),
        "candidate_s": statistics.median([t for m in rounds for t in m[candidate][part]]),
        "ratio": statistics.median(pairs), "q1": quartiles[0], "q3": quartiles[2],
        "per_round": per_round, "pairs": len(pairs),
    }  # fmt: skip


def breakdown(rounds: Sequence[dict[str, Timings]], reference: str, candidate: str) -> str:
    """One line per part of the step: medians of both and their paired ratio."""
    lines = []
    for part in ("forward", "backward", "optimizer"):
        if all(part in m[reference] and part in m[candidate] for m in rounds):
            c = compare(rounds, reference, candidate, part)
            label = "optimizer step and the rest" if part == "optimizer" else part
            lines.append(f"  {label:28} {reference} {c['reference_s'] * 1e3:8.2f} ms, {candidate}"
                         f" {c['candidate_s'] * 1e3:8.2f} ms, paired ratio {c['ratio']:.3f}")  # fmt: skip
    return "\n".join(lines)


def machine() -> str:
    """One line naming the machine, the date and the versions, for pasting next to the numbers."""
    import lightning

    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{time.strftime('%Y-%m-%d')}, {platform.system()} {cpu}, {os.cpu_count()} CPU cores, {gpu},"
            f" torch {torch.__version__}, lightning {lightning.__version__}")  # fmt: skip


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (readable in a terminal, pasteable into the README)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    lines = [fmt.format(*cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt.format(*row) for row in cells[1:]]
    return "\n".join(lines)


def print_comparison(c: dict[str, Any], labels: tuple[str, str], name: str, target: float) -> None:
    """The table of median step times and the paired ratio against its target, as both timing scripts print it."""
    print(table(
        ["configuration", "median step", "steps timed"],
        [[labels[0], f"{c['reference_s'] * 1e3:.2f} ms", c["pairs"]],
         [labels[1], f"{c['candidate_s'] * 1e3:.2f} ms", c["pairs"]]],
    ))  # fmt: skip
    verdict = "meets" if c["ratio"] <= target else "MISSES"
    print(f"\nratio {name}: {c['ratio']:.3f} (median of {c['pairs']} back-to-back step pairs;"
          f" quartiles {c['q1']:.3f}-{c['q3']:.3f}); {verdict} the target <= {target}")  # fmt: skip


def run_paired_rounds(
    configs: tuple[str, str],
    run: Callable[[Baton, str], Timings],
    rounds: int,
    dist_env: dict[str, str],
    rank: int,
    out: Path,
) -> None:
    """``rounds`` lockstep rounds of the two ``configs`` (the order alternating), each round's paired ratio
    printed on rank 0, and ``{"rounds", "seconds", "threads"}`` written to ``out`` by rank 0."""
    results = []
    start = time.perf_counter()
    for index in range(rounds):
        os.environ.update(dist_env)  # Lightning's environment deletes WORLD_SIZE at teardown
        order = configs if index % 2 == 0 else configs[::-1]
        results.append(run_lockstep({name: run for name in order}))
        if rank == 0:
            c = compare(results[-1:], *configs)
            print(f"round {index}: {configs[0]} {c['reference_s'] * 1e3:.2f} ms, {configs[1]}"
                  f" {c['candidate_s'] * 1e3:.2f} ms, paired ratio {c['ratio']:.3f}", flush=True)  # fmt: skip
    if rank == 0:
        payload = {
            "rounds": results,
            "seconds": time.perf_counter() - start,
            "threads": torch.get_num_threads(),
        }
        out.write_text(json.dumps(payload))
