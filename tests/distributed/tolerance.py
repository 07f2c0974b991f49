"""Low-precision parity: a tolerance measured on the one-process run, in units of the format's rounding.

A bf16 or fp16 run cannot match the one-process run to fp32's 1e-5: every place where a layout
rounds a partial result that one process keeps in higher precision (a data-parallel rank's
half-batch gradient, a tensor-parallel rank's partial product, a pipeline micro-batch's
gradient) moves the numbers by about one unit of the format, and training amplifies that. So the
tolerance of a case is *measured*: its one-process reference is run a second time with each
global batch accumulated in two halves (:func:`split_reference`), which changes nothing but where
the batch's reduction rounds. Their spread, times :data:`SAFETY`, is the tolerance:

- losses: ``|loss - ref| <= LOSS_SAFETY * max_step |split - ref|``; where the loss itself is
  computed in the format ("-true"), ``SAFETY`` times it and at least two units of its last place;
- parameters, every element: ``|p - ref| <= SAFETY * spread * eps * max(|ref|, rms(ref))``, where
  ``spread`` is the split run's largest difference in the same units (``eps``: the format's unit
  roundoff; ``rms`` over the tensor, so that entries near zero are judged at the tensor's scale).

The data is the learnable sequence (``Case.data="learnable"``), on which the loss must fall by at
least ``MOVEMENT * tolerance`` over the compared steps (asserted), so that a dropped or doubled
gradient shows. Measurements behind the numbers: docs/testing.md, "Low precision".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.distributed.cases import Case
from tests.distributed.harness import Result, references, run_problems

__all__ = [
    "LOSS_SAFETY",
    "MOVEMENT",
    "SAFETY",
    "UNIT_ROUNDOFF",
    "LowPrecisionTolerance",
    "assert_low_precision_parity",
    "check_low_precision",
    "measuring_runs",
    "split_parts",
    "split_reference",
    "with_split_references",
]

# Measured spread -> tolerance (docs/testing.md, "Low precision": over every low-precision case the
# layouts reached 1.6x the measuring runs' parameter spread and 4.5x their loss spread). The
# parameter spread is the largest of thousands of elements, a stable estimate of the noise; the
# loss spread is the largest of 4 to 6 numbers, a noisy one: hence its larger factor, except where
# the loss is computed in the format ("-true"): there the spread counts units in the loss's last
# place (measured: layouts at most 2 units when the measuring runs differed by 1), and SAFETY applies.
SAFETY = 4.0
LOSS_SAFETY = 8.0
MOVEMENT = 10.0  # the loss must fall by this many tolerances over the compared steps
# Unit roundoff of the format the parameters are rounded in (2^-(mantissa bits + 1)); "16-mixed"
# runs as bf16-mixed on the CPU.
UNIT_ROUNDOFF = {
    "bf16-mixed": 2.0**-8,
    "bf16-true": 2.0**-8,
    "16-mixed": 2.0**-8,
    "16-true": 2.0**-11,
    # fp8 (worker: torchao's float8 linears, emulated) runs under bf16 autocast with fp32 parameters:
    # the unit is bf16's, the autocast format, not e4m3's 2^-4 (the measured spread sets the bound).
    "fp8": 2.0**-8,
}
_LOSS_DTYPE = {"bf16-true": torch.bfloat16, "16-true": torch.float16}  # the loss is computed in it


def precision_of(case: Case) -> str:
    precision = str(case.trainer_kwargs.get("precision", "32-true"))
    if precision not in UNIT_ROUNDOFF:
        raise ValueError(
            f"{case.name}: precision {precision!r} is not a low precision: {sorted(UNIT_ROUNDOFF)}"
        )
    return precision


def split_parts(case: Case) -> int:
    """Into how many parts the measuring run accumulates each global batch.

    As many as the layout rounds separately (data-parallel ranks times pipeline micro-batches),
    at least two, and a divisor of the global batch.
    """
    kwargs = getattr(case.strategy, "kwargs", {}) or {}
    pipeline = int(kwargs.get("pipeline_parallel", 1))
    micro_batches = int(kwargs.get("micro_batches") or pipeline) if pipeline > 1 else 1
    samples = case.batch_size * case.dp
    parts = min(max(2, case.dp * micro_batches), samples)
    while samples % parts:
        parts -= 1
    if parts < 2:
        raise ValueError(f"{case.name}: a global batch of {samples} sample(s) cannot be split")
    return parts


def split_reference(case: Case) -> Case:
    """The measuring run: the reference with each global batch accumulated in :func:`split_parts` parts.

    Same samples, same order, same steps; the batch's gradient is summed from separately rounded parts.
    """
    accumulation = int(case.trainer_kwargs.get("accumulate_grad_batches", 1))
    parts = split_parts(case)
    return case.replace(
        name=f"{case.name}~split",
        batch_size=case.batch_size * case.dp // parts,
        data_parallel=1,
        trainer_kwargs={**case.trainer_kwargs, "accumulate_grad_batches": parts * accumulation},
    )


def measuring_runs(case: Case) -> list[Case]:
    """The runs a case's tolerance is measured on: the split reference, and the same with each batch
    in the reverse order (a second sample of the same rounding noise: the spread is their maximum)."""
    split = split_reference(case)
    return [split, split.replace(name=f"{case.name}~split-reversed", reversed_batches=True)]


def _batch_losses(split: Result, parts: int) -> list[float]:
    """The split run's per-batch losses, its parts averaged back into one global batch."""
    return [sum(split.losses[i : i + parts]) / parts for i in range(0, len(split.losses), parts)]


def _units(got: torch.Tensor, want: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``|got - want|`` and its unit ``eps * max(|want|, rms(want))``, elementwise, in float64."""
    want = want.detach().double()
    scale = want.pow(2).mean().sqrt() if want.numel() else want.new_zeros(())
    return (got.detach().double() - want).abs(), eps * torch.maximum(want.abs(), scale)


@dataclass(frozen=True)
class LowPrecisionTolerance:
    """A case's tolerance, from its reference and the split run (see the module docstring)."""

    precision: str
    loss_abs: float  # per step, in nats
    param_units: float  # per element, in units of eps * max(|ref|, rms(ref))
    measured_loss: float  # the split run's largest loss difference
    measured_param_units: float  # the split run's largest parameter difference, in units

    @classmethod
    def measure(
        cls, ref: Result, runs: list[Result], precision: str, parts: int = 2
    ) -> LowPrecisionTolerance:
        """From the reference and its measuring runs (:func:`measuring_runs`): their largest spread."""
        loss_spread = param_spread = 0.0
        for run in runs:
            losses = _batch_losses(run, parts)
            loss_spread = max(loss_spread, *(abs(a - b) for a, b in zip(losses, ref.losses, strict=True)))
            param_spread = max(param_spread, _worst_units(run, ref, precision))
        floor = 0.0
        if precision in _LOSS_DTYPE:  # two units in the last place of the largest loss
            largest = torch.tensor(max(abs(x) for x in ref.losses), dtype=_LOSS_DTYPE[precision])
            floor = 2 * float(torch.nextafter(largest, largest * 2) - largest)
        return cls(
            precision=precision,
            loss_abs=max((SAFETY if precision in _LOSS_DTYPE else LOSS_SAFETY) * loss_spread, floor),
            param_units=SAFETY * max(param_spread, 1.0),
            measured_loss=loss_spread,
            measured_param_units=param_spread,
        )

    def problems(self, result: Result, ref: Result) -> list[str]:
        """What in ``result`` lies outside the tolerance of ``ref`` (empty: parity)."""
        eps = UNIT_ROUNDOFF[self.precision]
        problems = run_problems(result, ref)
        for i, (got, want) in enumerate(zip(result.losses, ref.losses, strict=False)):
            if not abs(got - want) <= self.loss_abs:  # NaN fails
                problems.append(
                    f"loss of batch {i}: {got!r} vs reference {want!r} (tolerance {self.loss_abs:.3g})"
                )
        for name in sorted(set(ref.params) & set(result.params)):
            got, want = result.params[name], ref.params[name]
            if got.shape != want.shape:
                problems.append(f"parameter {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
                continue
            diff, unit = _units(got, want, eps)
            ratio = diff / unit
            worst = float(torch.nan_to_num(ratio, nan=math.inf).max()) if ratio.numel() else 0.0
            if not worst <= self.param_units:
                bad = int((~(ratio <= self.param_units)).sum())
                problems.append(
                    f"parameter {name}: {bad} of {ratio.numel()} elements beyond {self.param_units:.3g} units"
                    f" (worst {worst:.3g} units of {eps:.3g} x max(|ref|, rms))"
                )
        return problems


def assert_low_precision_parity(
    result: Result, ref: Result, runs: list[Result], case: Case
) -> LowPrecisionTolerance:
    """``result`` follows the one-process run of ``case`` within the tolerance ``split`` measures.

    Also asserts that the data moved the loss by ``MOVEMENT`` tolerances (else the comparison
    could not tell a wrong gradient from noise). Returns the tolerance, for reports.
    """
    if case.data != "learnable":
        raise AssertionError(f"{case.name}: low-precision cases train on data='learnable' (Case.data)")
    tolerance = LowPrecisionTolerance.measure(ref, runs, precision_of(case), split_parts(case))
    movement = max(ref.losses) - min(ref.losses)
    assert movement >= MOVEMENT * tolerance.loss_abs, (
        f"{case.name}: the reference loss moved {movement:.3g}, less than {MOVEMENT} x the tolerance"
        f" {tolerance.loss_abs:.3g}: train longer or on a sequence the model learns"
    )
    problems = tolerance.problems(result, ref)
    if problems:
        raise AssertionError(
            f"Case {result.name!r} ({tolerance.precision}) is outside its measured tolerance (loss"
            f" {tolerance.loss_abs:.3g} nats, parameters {tolerance.param_units:.3g} units; the split run"
            f" differed by {tolerance.measured_loss:.3g} and {tolerance.measured_param_units:.3g}):\n- "
            + "\n- ".join(problems)
        )
    return tolerance


def with_split_references(cases: list[Case]) -> list[Case]:
    """``cases`` and their measuring runs: what a fixture passes as ``references_for``."""
    low = [c for c in cases if str(c.trainer_kwargs.get("precision", "32-true")) in UNIT_ROUNDOFF]
    return [*cases, *(run for c in low for run in measuring_runs(c))]


def check_low_precision(result: Result, case: Case) -> LowPrecisionTolerance:
    """:func:`assert_low_precision_parity` against the case's (cached) reference and split run."""
    runs = measuring_runs(case)
    found = references([case, *runs])
    ref = found[case.name]
    tolerance = assert_low_precision_parity(result, ref, [found[run.name] for run in runs], case)
    worst_loss = max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True))
    print(  # shown with pytest -s: the figures behind docs/testing.md's table
        f"\n{case.name}: loss moved {max(ref.losses) - min(ref.losses):.3g}; split spread {tolerance.measured_loss:.3g}"
        f" nats / {tolerance.measured_param_units:.3g} units; case {worst_loss:.3g} nats /"
        f" {_worst_units(result, ref, tolerance.precision):.3g} units; tolerance {tolerance.loss_abs:.3g} /"
        f" {tolerance.param_units:.3g}"
    )
    return tolerance


def _worst_units(result: Result, ref: Result, precision: str) -> float:
    worst = 0.0
    for name, want in ref.params.items():
        diff, unit = _units(result.params[name], want, UNIT_ROUNDOFF[precision])
        worst = max(worst, float((diff / unit).max()))
    return worst
