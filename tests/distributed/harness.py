"""Parity harness: train cases in N CPU processes through the real Trainer, compare with one process.

    results = run_cases(["ddp2_nanogpt", "ddp2_hf_gpt2"], world_size=2)   # one launch, both cases
    assert_parity(results["ddp2_nanogpt"], reference("ddp2_nanogpt"))     # reference: 1 process
    check_parity(["ddp2_nanogpt", "ddp2_hf_gpt2"])  # the same, references in the same launch

A launch starts ``world_size`` ``python -m tests.distributed.worker`` subprocesses (own session
each, output to files), which run all the cases in sequence over one gloo process group, then
(optionally) single-process references with the group closed. The parent fails fast: the
first rank that exits non-zero, or exits 0 without its done-marker (an error swallowed), gets
every other rank killed and a :class:`HarnessError` with every rank's traceback and output
tail; so does the hard timeout. References never run in pytest's own process (no Trainer state
leaks into other tests) and are cached for the session.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.distributed.cases import ATOL, CASES, RTOL, Case
from tests.distributed.compute_dtype import compute_dtype_problems
from tests.environment import release_build_locks, worker_environment
from tests.warm_workers import WarmProcess, spawn

__all__ = [
    "HarnessError",
    "launch_fails",
    "Result",
    "assert_parity",
    "check_parity",
    "mean_over_ranks",
    "merge_replicas",
    "mismatch",
    "reference",
    "references",
    "run_cases",
    "run_problems",
    "shared_loss_problems",
]

ROOT = Path(__file__).resolve().parents[2]
_TAIL_CHARS = 3000


class HarnessError(RuntimeError):
    """A launch failed: a rank crashed, exited without finishing, or the launch timed out.

    ``directory`` is the launch's kept temp directory (logs, tracebacks, partial results).
    """

    def __init__(self, message: str, directory: Path | None = None) -> None:
        super().__init__(message)
        self.directory = directory


@dataclass
class Result:
    """What one case produced (on rank 0, gathered from all ranks)."""

    name: str
    losses: list[float]  # per training batch; mean over the ranks that returned a loss
    params: dict[str, torch.Tensor]  # final parameters, full tensors, by the user's module names
    global_step: int  # optimizer steps taken
    world_size: int
    data_parallel: int  # the sampler's num_replicas (reference: the case's data_parallel)
    wall_s: float  # seconds in trainer.fit on rank 0
    case_s: float  # seconds for the whole case on rank 0: model, Trainer, fit, gathering, saving
    startup_s: float  # seconds from spawning rank 0 to its first case (imports, process group)
    rank_losses: list[list[float | None]] = field(default_factory=list)  # per rank, before averaging
    replica_mismatches: dict[str, str] = field(default_factory=dict)  # copies on ranks that disagree
    facts: dict[str, int] = field(
        default_factory=dict
    )  # what the strategy did, for "it really engaged" asserts
    rank_coordinates: list[dict[str, int]] = field(default_factory=list)  # per rank, on the mesh's axes
    engagement: dict = field(default_factory=dict)  # what ran (tests/distributed/engagement.py)
    engagement_problems: list[str] = field(default_factory=list)  # rows of the case that did not engage
    precision: str = "32-true"  # Trainer(precision=...) of the case
    # Matrix products of the training forward and recomputed forwards, summed over ranks, by
    # "<phase>.<kernel>.<dtype>" (tests/distributed/compute_dtype.py).
    compute_dtypes: dict[str, int] = field(default_factory=dict)
    initial_params: dict[str, torch.Tensor] = field(default_factory=dict)  # references: before training


# Axes whose ranks share one batch and must report one loss: tensor and context parallel.
SHARED_LOSS_AXES = ("tp", "cp")


def shared_loss_problems(result: Result) -> list[str]:
    """Ranks of one tensor- (or context-) parallel group that reported different losses.

    Shard-local losses could average over the group to the right value; the group's ranks hold
    the same batch and the same reduced logits, so each must return the loss itself.
    """
    groups: dict[tuple, list[int]] = {}
    for rank, coords in enumerate(result.rank_coordinates):
        if not coords:  # no mesh (Lightning's own strategies): every rank is its own replica
            continue
        key = tuple(sorted((k, v) for k, v in coords.items() if k not in SHARED_LOSS_AXES))
        groups.setdefault(key, []).append(rank)
    problems = []
    for ranks in groups.values():
        if len(ranks) < 2:
            continue
        for step in range(len(result.rank_losses[ranks[0]])):
            values = {rank: result.rank_losses[rank][step] for rank in ranks}
            present = [v for v in values.values() if v is not None]
            if present and (
                len(present) != len(values) or max(present) - min(present) > RTOL * abs(present[0])
            ):
                problems.append(
                    f"batch {step}: ranks {ranks} of one tensor/context-parallel group reported {values}"
                )
    return problems


def mean_over_ranks(rank_losses: list[list[float | None]]) -> list[float]:
    """Per batch, the mean over the ranks that returned a loss (``None``: no loss on that rank).

    Every data-parallel replica has the same number of loss-holding ranks (its tensor-parallel
    ranks, or those of its last pipeline stage), so this is the mean over replicas: the loss of
    the global batch. A batch where no rank has a loss gives NaN (and fails parity).
    """
    lengths = [len(losses) for losses in rank_losses]
    if len(set(lengths)) != 1:
        raise RuntimeError(f"Ranks ran different numbers of batches: {lengths}")
    means = []
    for step in zip(*rank_losses, strict=True):
        values = [v for v in step if v is not None]
        means.append(math.fsum(values) / len(values) if values else math.nan)
    return means


def mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> str | None:
    """``None`` if ``|got - want| <= atol + rtol * |want|`` everywhere (NaN never), else what differs.

    The rule of ``torch.testing.assert_close``, whose first call costs seconds of imports.
    """
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs reference {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach().double()
    diff = (got - want).abs()
    bad = ~(diff <= atol + rtol * want.abs())  # NaN compares False: counted as bad
    if not bad.any():
        return None
    worst = int(torch.nan_to_num(diff, nan=math.inf).flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape))
    rel_norm = float(diff.norm() / want.norm()) if want.norm() > 0 else math.inf
    return (
        f"{int(bad.sum())} of {got.numel()} elements differ; greatest difference "
        f"{float(diff.flatten()[worst]):.3g} at {index} ({float(got.flatten()[worst])!r} vs "
        f"{float(want.flatten()[worst])!r}); relative norm of the difference {rel_norm:.3g}"
    )


def merge_replicas(
    rank_params: list[dict[str, torch.Tensor]], rtol: float = RTOL, atol: float = ATOL
) -> dict:
    """One tensor per parameter name (the lowest rank's) and the names whose copies disagree.

    Returns ``{"params": {name: tensor}, "replica_mismatches": {name: message}}``.
    """
    params: dict[str, torch.Tensor] = {}
    mismatches: dict[str, str] = {}
    for rank, named in enumerate(rank_params):
        for name, tensor in named.items():
            if name not in params:
                params[name] = tensor
                continue
            problem = mismatch(tensor, params[name], rtol, atol)
            if problem:
                mismatches.setdefault(name, f"rank {rank} differs from a lower rank's copy: {problem}")
    return {"params": params, "replica_mismatches": mismatches}


def _resolve(cases: Sequence[Case | str]) -> list[Case]:
    resolved = [CASES[c] if isinstance(c, str) else c for c in cases]
    names = [c.name for c in resolved]
    if len(set(names)) != len(names):
        raise ValueError(f"Case names must be unique in a launch: {names}")
    return resolved


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path) -> str:
    if not path.exists():
        return "<no output>"
    text = path.read_bytes()[-_TAIL_CHARS:].decode(errors="replace")
    return text if text.strip() else "<no output>"


class _Launch:
    """``nprocs`` worker processes: the distributed ``cases``, then the ``refs``; :meth:`wait` collects."""

    def __init__(
        self,
        cases: list[Case],
        refs: list[Case],
        nprocs: int,
        pg_timeout_s: float = 60.0,
        init_pg: bool = True,
        command: list[str] | None = None,  # tests of the harness replace the worker
    ) -> None:
        self.cases, self.refs, self.nprocs = cases, refs, nprocs
        self.dir = Path(tempfile.mkdtemp(prefix="lp-harness-"))
        (self.dir / "cases.pkl").write_bytes(pickle.dumps({"distributed": cases, "reference": refs}))
        cmd = [sys.executable, "-m", "tests.distributed.worker", "--cases", str(self.dir / "cases.pkl"),
               "--out", str(self.dir), "--pg-timeout", str(pg_timeout_s)]  # fmt: skip
        if not init_pg:
            cmd.append("--no-init-pg")
        port = _free_port()
        self.start = time.monotonic()
        self.procs: list[WarmProcess | subprocess.Popen] = []
        for rank in range(nprocs):
            env = worker_environment()
            env["LP_HARNESS_LAUNCH_TIME"] = repr(time.time())
            if cases:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                           NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
            self.procs.append(spawn(command or cmd, env, ROOT, self.dir / f"rank{rank}.log"))

    def wait(self, timeout_s: float) -> tuple[dict[str, Result], dict[tuple, Result]]:
        """Results by case name, and references by ``reference_key()``; kills everything on failure."""
        try:
            failure = self._poll(self.start + timeout_s)
        except BaseException:  # pytest-timeout, Ctrl-C: never leave workers behind
            self._kill()
            raise
        if failure:
            self._kill()
            raise HarnessError(self._report(failure), self.dir)
        results = {case.name: self._load(f"result.{i}.pt", case) for i, case in enumerate(self.cases)}
        refs = {
            case.reference_key(): self._load(f"reference.{i}.pt", case) for i, case in enumerate(self.refs)
        }
        shutil.rmtree(self.dir, ignore_errors=True)
        return results, refs

    def _poll(self, deadline: float) -> str | None:
        """Wait until every rank finished (``None``) or one failed or time ran out (the reason)."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [rank for rank, code in enumerate(codes) if code is not None and code != 0]
            if failed:  # several seen at once: the first to fail (its error file), not the lowest rank
                rank = min(failed, key=self._error_time)
                return f"rank {rank} exited with status {codes[rank]}"
            for rank, code in enumerate(codes):
                if code == 0 and not (self.dir / f"done.rank{rank}").exists():
                    return f"rank {rank} exited with status 0 without finishing (an error swallowed?)"
            if all(code == 0 for code in codes):
                return None
            if time.monotonic() > deadline:
                return f"timed out after {deadline - self.start:.0f} s; all ranks killed"
            time.sleep(0.05)

    def _error_time(self, rank: int) -> float:
        """When the rank recorded its error (``error.rank<r>.txt``); a rank without one sorts last."""
        error = self.dir / f"error.rank{rank}.txt"
        return error.stat().st_mtime if error.exists() else math.inf

    def _load(self, filename: str, case: Case) -> Result:
        path = self.dir / filename
        if not path.exists():
            raise HarnessError(
                self._report(f"all ranks finished but {case.name!r} wrote no {filename}"), self.dir
            )
        return Result(**torch.load(path, weights_only=True))

    def _kill(self) -> None:
        killed = False
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                    killed = True
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()
        if killed:
            release_build_locks()

    def _report(self, reason: str) -> str:
        names = [c.name for c in self.cases] + [f"{c.name} (reference)" for c in self.refs]
        lines = [f"Harness launch of {self.nprocs} process(es) for {names} failed: {reason}.",
                 f"Files kept in {self.dir}"]  # fmt: skip
        for rank, p in enumerate(self.procs):
            error = self.dir / f"error.rank{rank}.txt"
            status = "killed by the harness" if p.returncode == -signal.SIGKILL else f"status {p.returncode}"
            lines.append(f"\n===== rank {rank} ({status}) =====")
            if error.exists():
                lines.append(error.read_text())
            lines.append(f"--- output tail ---\n{_tail(self.dir / f'rank{rank}.log')}")
        return "\n".join(lines)

    def port_in_use(self) -> bool:
        logs = (_tail(self.dir / f"rank{r}.log").lower() for r in range(self.nprocs))
        return any("address already in use" in log for log in logs)


_REFERENCES: dict[tuple, Result] = {}  # this session's references, by Case.reference_key()


def _missing_references(cases: Sequence[Case]) -> list[Case]:
    return list({c.reference_key(): c for c in cases if c.reference_key() not in _REFERENCES}.values())


def _launch(
    cases: list[Case], refs: list[Case], nprocs: int, timeout_s: float, **kwargs
) -> dict[str, Result]:
    """One launch (retried once if the rendezvous port was taken); caches the references it ran."""
    for attempt in range(2):
        launch = _Launch(cases, refs, nprocs, **kwargs)
        try:
            results, ran = launch.wait(timeout_s)
        except HarnessError:
            if attempt == 0 and cases and launch.port_in_use():
                shutil.rmtree(launch.dir, ignore_errors=True)
                continue  # another test took the port between _free_port() and the bind
            raise
        _REFERENCES.update(ran)
        return results
    raise AssertionError("unreachable")


@contextmanager
def launch_fails(match: str) -> Iterator[pytest.ExceptionInfo[HarnessError]]:
    """``pytest.raises(HarnessError, match=...)`` for a launch a test expects to fail; the folder the harness
    keeps for a failure (logs, tracebacks) is removed once the failure was the expected one."""
    with pytest.raises(HarnessError, match=match) as info:
        yield info
    if info.value.directory is not None:
        shutil.rmtree(info.value.directory, ignore_errors=True)


def run_cases(
    cases: Sequence[Case | str],
    world_size: int | None = None,
    timeout_s: float = 300.0,
    *,
    pg_timeout_s: float = 60.0,
    init_process_group: bool = True,
    references_for: Sequence[Case | str] = (),
) -> dict[str, Result]:
    """Train every case in ONE launch of ``world_size`` processes; results by case name.

    Args:
        cases: :class:`Case` objects or names in ``CASES``; all with this ``world_size``.
        world_size: Processes; ``None`` takes the cases' own.
        timeout_s: Hard limit for the whole launch; then every rank is killed.
        pg_timeout_s: Timeout of the gloo process group: a rank blocked in a collective because
            a peer is stuck fails after this long.
        init_process_group: ``False`` lets the first case's strategy open the process group
            (then its own timeout applies).
        references_for: Cases whose references (see :func:`references`) the same processes
            compute after the distributed cases, if not cached yet; no extra process start-up.

    Raises:
        HarnessError: any rank failed, exited without finishing, or the launch timed out.
    """
    resolved = _resolve(cases)
    sizes = {c.world_size for c in resolved}
    if world_size is None and len(sizes) == 1:
        world_size = sizes.pop()
    if not resolved or sizes - {world_size}:
        raise ValueError(
            f"run_cases needs cases all of world_size={world_size}: {[(c.name, c.world_size) for c in resolved]}"
        )
    refs = _missing_references(_resolve(references_for))
    return _launch(
        resolved, refs, world_size, timeout_s, pg_timeout_s=pg_timeout_s, init_pg=init_process_group
    )


def references(cases: Sequence[Case | str], timeout_s: float = 300.0) -> dict[str, Result]:
    """Single-process references of ``cases`` by case name; the missing ones in one subprocess.

    Each trains the case's family with ``strategy="auto"``, ``devices=1``, the same trainer
    kwargs, ``batch_size * data_parallel`` samples per batch, ordered by the permutation the
    distributed samplers split (``tests.models.families.reference_dataloader``): batch ``i``
    holds exactly the samples of batch ``i`` of all data-parallel ranks together. Cached per
    ``Case.reference_key()`` for the session, so cases differing only by strategy share one.
    """
    resolved = _resolve(cases)
    missing = _missing_references(resolved)
    if missing:
        _launch([], missing, 1, timeout_s)
    return {c.name: _REFERENCES[c.reference_key()] for c in resolved}


def reference(case: Case | str, timeout_s: float = 300.0) -> Result:
    """The single-process reference of one case (see :func:`references`)."""
    resolved = _resolve([case])[0]
    return references([resolved], timeout_s)[resolved.name]


def precision_problems(result: Result, ref: Result) -> list[str]:
    """The run or its reference computed a matrix product in another dtype than the reference's precision
    asks for (tests/distributed/compute_dtype.py); ``16-mixed`` without a loss scale."""
    problems = compute_dtype_problems(result.compute_dtypes, ref.precision, f"{result.name!r}")
    problems += compute_dtype_problems(ref.compute_dtypes, ref.precision, f"the reference of {result.name!r}")
    if ref.precision == "16-mixed":
        # The scales each run ended with: loss scaling engaged, steps skipped alike. The reference starts at
        # data_parallel times the run's scale (the same fp16 gradients: tests/distributed/worker.py).
        replicas = max(result.data_parallel, 1)
        scales = {result.name: result.facts.get("loss_scale"), "reference": ref.facts.get("loss_scale")}
        run_scale, ref_scale = scales.values()
        if None in scales.values() or 1.0 in scales.values() or run_scale * replicas != ref_scale:
            problems.append(
                f"16-mixed loss scales {scales}: none, 1 (not engaged), or not {replicas} times the run's in the"
                " reference (another step skipped)"
            )
    return problems


def run_problems(result: Result, ref: Result) -> list[str]:
    """What fails a run whatever the tolerance: another shape of run (replicas, steps, batches,
    parameter names), replicas out of sync, a tp/cp group without one loss, a feature not engaged,
    a matrix product in another dtype than the precision asks for."""
    problems = precision_problems(result, ref)
    if result.data_parallel != ref.data_parallel:
        problems.append(f"data-parallel replicas: strategy's sampler has {result.data_parallel}, "
                        f"case declares {ref.data_parallel} (set Case.data_parallel)")  # fmt: skip
    if result.global_step != ref.global_step:
        problems.append(f"optimizer steps: {result.global_step} vs reference {ref.global_step}")
    if len(result.losses) != len(ref.losses):
        problems.append(f"batches: {len(result.losses)} vs reference {len(ref.losses)}")
    missing = sorted(set(ref.params) ^ set(result.params))
    if missing:
        problems.append(f"parameter names differ from the single-process module: {missing}")
    for name, message in result.replica_mismatches.items():
        problems.append(f"replicas out of sync for {name}: {message}")
    problems += shared_loss_problems(result)
    return problems + [f"not engaged: {p}" for p in result.engagement_problems]


def assert_parity(result: Result, ref: Result, rtol: float = RTOL, atol: float = ATOL) -> None:
    """``result`` trained exactly as ``ref``: same steps, per-batch losses, final parameters.

    Losses: ``|loss - ref| / |ref| < rtol`` for every batch. Parameters, per tensor and per
    element: ``|p - ref| <= atol + rtol * |ref|`` (the rule of ``torch.testing.assert_close``,
    see :func:`mismatch`). Elementwise rather than a relative norm of each tensor, because a
    single wrong shard, row or expert must fail even when it is a small part of a large tensor,
    which a norm over the whole tensor dilutes. ``atol=1e-6`` is for entries near zero, where
    rounding from a different reduction order (fp32: ~1e-7 of the gradient's scale) is large
    relative to the entry. Copies of a parameter on different ranks must agree too.
    """
    problems = run_problems(result, ref)
    for i, (got, want) in enumerate(zip(result.losses, ref.losses, strict=False)):
        rel = abs(got - want) / abs(want) if want else abs(got)
        if not rel < rtol:  # also catches NaN
            problems.append(
                f"loss of batch {i}: {got!r} vs reference {want!r} (relative difference {rel:.3g})"
            )
    for name in sorted(set(ref.params) & set(result.params)):
        problem = mismatch(result.params[name], ref.params[name], rtol, atol)
        if problem:
            problems.append(f"parameter {name}: {problem}")
    if problems:
        raise AssertionError(f"Case {result.name!r} does not match its single-process reference:\n- "
                             + "\n- ".join(problems))  # fmt: skip


def check_parity(
    cases: Sequence[Case | str],
    world_size: int | None = None,
    timeout_s: float = 300.0,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> dict[str, Result]:
    """Run ``cases`` and their missing references in one launch; assert every case.

    Raises one ``AssertionError`` listing every case that does not match its reference.
    """
    resolved = _resolve(cases)
    results = run_cases(resolved, world_size, timeout_s, references_for=resolved)
    failures = []
    for case in resolved:
        try:
            assert_parity(results[case.name], _REFERENCES[case.reference_key()], rtol, atol)
        except AssertionError as err:
            failures.append(str(err))
    if failures:
        raise AssertionError("\n\n".join(failures))
    return results
