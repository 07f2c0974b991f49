"""Low-precision parity: a tolerance measured on the one-process run, in units of the format's rounding.

A bf16 or fp16 run cannot match the one-process run to fp32's 1e-5: every place where a layout
rounds a partial result that one process keeps in higher precision (a data-parallel rank's
half-batch gradient, a tensor-parallel rank's partial product, a pipeline micro-batch's
gradient) moves the numbers by about one unit of the format, and training amplifies that. So the
tolerance of a case is *measured*: its one-process reference is run twice more with each global
batch accumulated in parts (:func:`measuring_runs`), which changes nothing but where the batch's
reduction rounds. Their spread, times :data:`SAFETY`, is the tolerance:

- losses: ``|loss - ref| <= LOSS_SAFETY * max_step |split - ref|``; where the loss itself is
  computed in the format ("-true"), ``SAFETY`` times it and at least two units of its last place;
- parameters, every element of parameter ``P``: ``|p - ref| <= SAFETY * spread(P) * eps * max(|ref|,
  rms(ref))``, where ``spread(P)`` is the measuring runs' largest difference on ``P`` in the same units
  (``eps``: the format's unit roundoff; ``rms`` over the tensor, so that entries near zero are judged at
  the tensor's scale), at least one unit. Per parameter: a zero-initialised bias, whose units are its own
  small values, differs by tens of units where a weight matrix differs by one; one spread for all would
  let every weight drift by the biases' noise.

Both must be able to fail: the data is the learnable sequence (``Case.data="learnable"``), on which
the loss must fall by at least ``MOVEMENT`` loss tolerances over the compared steps, and every weight
matrix of the reference must move at least ``MOVEMENT`` of its own tolerances (:class:`Movement`), so
that a dropped or doubled gradient shows; vectors that move less (norm gains) are compared but not
counted. Measurements behind the numbers: docs/testing.md, "Low precision".
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
    "Movement",
    "assert_low_precision_parity",
    "check_low_precision",
    "measuring_runs",
    "parameter_movement",
    "per_parameter_spread",
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
# Unit roundoff of the format the products are rounded in (2^-(mantissa bits + 1)); "16-mixed" is fp16
# autocast on the CPU too (the worker passes Lightning's MixedPrecision("16-mixed", "cpu")).
UNIT_ROUNDOFF = {
    "bf16-mixed": 2.0**-8,
    "bf16-true": 2.0**-8,
    "16-mixed": 2.0**-11,
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
class Movement:
    """How far each parameter of the one-process run moved in training, in tolerances of that parameter.

    ``judged``: moved at least ``MOVEMENT`` tolerances (its worst element): a dropped or wrong gradient
    of it shows, so its agreement is evidence. ``short``: a randomly initialised tensor (the weights and
    embeddings a layout shards, reduces and sends) that moved less: the case must train longer or at a
    larger rate. ``unjudged``: a tensor initialised to a constant (biases at 0, norm gains at 1) that
    moved less: a few SGD steps leave norm gains within their rounding, and a bias's units are its own
    small values; still compared (it must not move where the reference did not), never counted.
    """

    judged: dict[str, float]
    short: dict[str, float]
    unjudged: dict[str, float]


def constant_initialised(ref: Result) -> set[str]:
    """The reference's parameters that started as one repeated value (biases at 0, norm gains at 1)."""
    return {n for n, p in ref.initial_params.items() if p.numel() and bool((p == p.flatten()[0]).all())}


def parameter_movement(ref: Result, precision: str) -> dict[str, float]:
    """Per parameter, ``max |final - initial|`` of the reference, in units ``eps * max(|final|, rms(final))``."""
    if not ref.initial_params:
        raise AssertionError(
            f"the reference of {ref.name!r} recorded no initial parameters (tests/distributed/worker.py)"
        )
    moved = {}
    for name, final in ref.params.items():
        diff, unit = _units(ref.initial_params[name], final, UNIT_ROUNDOFF[precision])
        moved[name] = float((diff / unit).max()) if diff.numel() else 0.0
    return moved


@dataclass(frozen=True)
class LowPrecisionTolerance:
    """A case's tolerance, from its reference and the measuring runs (see the module docstring)."""

    precision: str
    loss_abs: float  # per step, in nats
    param_units: dict[str, float]  # per parameter, per element, in units of eps * max(|ref|, rms(ref))
    measured_loss: float  # the measuring runs' largest loss difference
    measured_param_units: dict[str, float]  # per parameter, their largest difference, in units

    @classmethod
    def measure(
        cls, ref: Result, runs: list[Result], precision: str, parts: int = 2, per_parameter: bool = True
    ) -> LowPrecisionTolerance:
        """From the reference and its measuring runs (:func:`measuring_runs`): their largest spread, per
        parameter, or over all of them (``per_parameter=False``: Adam, see :func:`per_parameter_spread`)."""
        loss_spread = 0.0
        spread = dict.fromkeys(ref.params, 0.0)
        for run in runs:
            losses = _batch_losses(run, parts)
            loss_spread = max(loss_spread, *(abs(a - b) for a, b in zip(losses, ref.losses, strict=True)))
            for name, units in _units_by_name(run, ref, precision).items():
                spread[name] = max(spread[name], units)
        floor = 0.0
        if precision in _LOSS_DTYPE:  # two units in the last place of the largest loss
            largest = torch.tensor(max(abs(x) for x in ref.losses), dtype=_LOSS_DTYPE[precision])
            floor = 2 * float(torch.nextafter(largest, largest * 2) - largest)
        if not per_parameter:
            spread = dict.fromkeys(spread, max(spread.values()))
        return cls(
            precision=precision,
            loss_abs=max((SAFETY if precision in _LOSS_DTYPE else LOSS_SAFETY) * loss_spread, floor),
            param_units={name: SAFETY * max(units, 1.0) for name, units in spread.items()},
            measured_loss=loss_spread,
            measured_param_units=spread,
        )

    def judged(self, ref: Result) -> Movement:
        """Which of the reference's parameters trained far enough to be judged (see :class:`Movement`)."""
        ratios = {n: m / self.param_units[n] for n, m in parameter_movement(ref, self.precision).items()}
        constant = {
            n for n, p in ref.initial_params.items() if p.numel() and bool((p == p.flatten()[0]).all())
        }
        return Movement(
            judged={n: r for n, r in ratios.items() if r >= MOVEMENT},
            short={n: r for n, r in ratios.items() if r < MOVEMENT and n not in constant},
            unjudged={n: r for n, r in ratios.items() if r < MOVEMENT and n in constant},
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
            got, want, tolerance = result.params[name], ref.params[name], self.param_units[name]
            if got.shape != want.shape:
                problems.append(f"parameter {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
                continue
            diff, unit = _units(got, want, eps)
            ratio = diff / unit
            worst = float(torch.nan_to_num(ratio, nan=math.inf).max()) if ratio.numel() else 0.0
            if not worst <= tolerance:
                bad = int((~(ratio <= tolerance)).sum())
                problems.append(
                    f"parameter {name}: {bad} of {ratio.numel()} elements beyond {tolerance:.3g} units"
                    f" (worst {worst:.3g} units of {eps:.3g} x max(|ref|, rms))"
                )
        return problems


def per_parameter_spread(case: Case) -> bool:
    """Whether a parameter's own spread measures its noise: under SGD (linear in the gradient) its rounding
    follows its tensor's scale. Adam divides every element by its own history, so a near-zero gradient's
    rounding becomes an update of up to ``lr`` anywhere (docs/testing.md, "Adam and the parameter
    tolerance"): two measuring runs sample that tail per tensor too thinly (measured: layouts 2.5-4.5x
    a tensor's own tolerance), and the spread over the whole model is its estimate."""
    return dict(case.model_kwargs).get("optimizer", "sgd") != "adamw"


def assert_low_precision_parity(
    result: Result, ref: Result, runs: list[Result], case: Case, judged: bool = True
) -> LowPrecisionTolerance:
    """``result`` follows the one-process run of ``case`` within the tolerance the measuring runs give.

    Also asserts that the data moved the loss by ``MOVEMENT`` tolerances and every randomly initialised
    parameter by ``MOVEMENT`` of its own (else the comparison could not tell a wrong gradient from noise);
    ``judged=False`` leaves that out, for the runs that cannot (listed as such in their tests, never in
    the compatibility matrix). Returns the tolerance, for reports.
    """
    if case.data != "learnable":
        raise AssertionError(f"{case.name}: low-precision cases train on data='learnable' (Case.data)")
    tolerance = LowPrecisionTolerance.measure(
        ref, runs, precision_of(case), split_parts(case), per_parameter=per_parameter_spread(case)
    )
    fall = max(ref.losses) - min(ref.losses)
    assert fall >= MOVEMENT * tolerance.loss_abs, (
        f"{case.name}: the reference loss moved {fall:.3g}, less than {MOVEMENT} x the tolerance"
        f" {tolerance.loss_abs:.3g}: train longer or on a sequence the model learns"
    )
    movement = tolerance.judged(ref)
    assert not judged or (movement.judged and not movement.short), (
        f"{case.name}: every randomly initialised parameter must move {MOVEMENT} x its tolerance to be judged;"
        f" these moved less (in tolerances): { {n: round(r, 2) for n, r in movement.short.items()} }: train"
        " longer or at a larger rate"
    )
    problems = tolerance.problems(result, ref)
    if problems:
        raise AssertionError(
            f"Case {result.name!r} ({tolerance.precision}) is outside its measured tolerance (loss"
            f" {tolerance.loss_abs:.3g} nats, parameters {_span(tolerance.param_units)} units; the measuring runs"
            f" differed by {tolerance.measured_loss:.3g} and {_span(tolerance.measured_param_units)}):\n- "
            + "\n- ".join(problems)
        )
    return tolerance


def with_split_references(cases: list[Case]) -> list[Case]:
    """``cases`` and their measuring runs: what a fixture passes as ``references_for``."""
    low = [c for c in cases if str(c.trainer_kwargs.get("precision", "32-true")) in UNIT_ROUNDOFF]
    return [*cases, *(run for c in low for run in measuring_runs(c))]


def check_low_precision(result: Result, case: Case, judged: bool = True) -> LowPrecisionTolerance:
    """:func:`assert_low_precision_parity` against the case's (cached) reference and measuring runs."""
    runs = measuring_runs(case)
    found = references([case, *runs])
    ref = found[case.name]
    tolerance = assert_low_precision_parity(result, ref, [found[run.name] for run in runs], case, judged)
    worst_loss = max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True))
    judged = tolerance.judged(ref)
    random_judged = [r for n, r in judged.judged.items() if n not in constant_initialised(ref)]
    worst = {
        n: u / tolerance.param_units[n] for n, u in _units_by_name(result, ref, tolerance.precision).items()
    }
    print(  # shown with pytest -s: the figures behind docs/testing.md's table
        f"\n{case.name}: loss moved {max(ref.losses) - min(ref.losses):.3g}; spread {tolerance.measured_loss:.3g}"
        f" nats / {_span(tolerance.measured_param_units)} units; case {worst_loss:.3g} nats / at most"
        f" {max(worst.values()):.2f} of a parameter's tolerance; tolerance {tolerance.loss_abs:.3g} /"
        f" {_span(tolerance.param_units)}; judged {len(judged.judged)} parameters, short {len(judged.short)}"
        f" (random ones moved at least {min([*judged.short.values(), *random_judged], default=0):.3g}"
        f" tolerances), unjudged {len(judged.unjudged)}"
    )
    return tolerance


def _units_by_name(result: Result, ref: Result, precision: str) -> dict[str, float]:
    """Per parameter of ``ref``, the worst element of ``result`` against it, in units (see :func:`_units`)."""
    worst = {}
    for name, want in ref.params.items():
        diff, unit = _units(result.params[name], want, UNIT_ROUNDOFF[precision])
        worst[name] = float(torch.nan_to_num(diff / unit, nan=math.inf).max()) if diff.numel() else 0.0
    return worst


def _span(by_name: dict[str, float]) -> str:
    return f"{min(by_name.values()):.3g}-{max(by_name.values()):.3g}"
