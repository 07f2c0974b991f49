"""The step-time model against published runs it was not fitted to: leave one source out.

What the planner fits is one number per chip and matmul precision, the fraction of the tensor-core peak a
step's matmuls run at (``Cluster.matmul_efficiency``); everything else comes from datasheets and the
layout. The protocol:

1. Rows: published training runs (``published_runs.json``, each with its source's link and the
   configuration the source states; gathered from Megatron-LM, NVIDIA's NeMo / Megatron-Bridge
   performance pages, torchtitan, and papers; the lent H200's own measurements) and the two tables of
   ``published.py``, as the planner's inputs (``published_rows.py``). A row the model cannot express is
   kept out, with the reason, never guessed; a run its publisher measured again in a later release counts
   once, at its latest figure (the table's last line gives the error counting every release).
2. Sources are grouped by who measured them (``SOURCE_GROUPS``: NVIDIA's NeMo pages and Megatron-Bridge's
   are one publisher, torchtitan's repository, docs and paper another, ...).
3. For each group, the efficiencies are fitted on every other group's rows only (per chip and precision,
   minimising the mean absolute log error of the step time; a chip and precision no other group has falls
   back to the chip's fit over any precision, then to one number over all rows), and the group's rows are
   predicted with them: the out-of-sample error. The in-sample error (fitted on all rows) is shown beside
   it, never instead.

``python -m lightning_parallel.planner.validation`` prints the table; ``--write`` puts it in
docs/planner.md. The tests pin the protocol (which rows a fold fits on), not the figures.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_parallel.planner.cluster import CLUSTERS
from lightning_parallel.planner.published_rows import ARCHITECTURES, Row, load_rows
from lightning_parallel.planner.timing import step_time

__all__ = ["Fold", "Row", "fit", "leave_one_source_out", "load_rows", "markdown"]

_EFFICIENCY_BOUNDS = (0.1, 1.0)
Predictor = Callable[[Row, float], float]


# (id of a row's setup, efficiency) -> (that setup, kept alive so its id is not reused; the step): the search revisits
_PREDICTED: dict[tuple[int, float], tuple[object, float]] = {}


def predict(row: Row, efficiency: float) -> float:
    """Predicted step seconds of ``row`` with its chip's matmuls at ``efficiency`` of the peak."""
    assert row.setup is not None
    key = (id(row.setup), round(efficiency, 4))
    if key not in _PREDICTED:
        shape, layout, execution = row.setup
        cluster = replace(CLUSTERS[row.cluster or row.chip], matmul_efficiency=key[1])
        _PREDICTED[key] = (row.setup, step_time(shape, layout, cluster, execution).total)
    return _PREDICTED[key][1]


def _error(row: Row, efficiency: float, predictor: Predictor) -> float:
    return abs(math.log(predictor(row, efficiency) / row.published_step_s))


def _best(rows: Sequence[Row], predictor: Predictor) -> float:
    """The efficiency minimising the rows' mean absolute log error (golden-section search: unimodal in it)."""
    low, high = _EFFICIENCY_BOUNDS
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        a, b = high - ratio * (high - low), low + ratio * (high - low)
        if sum(_error(r, a, predictor) for r in rows) <= sum(_error(r, b, predictor) for r in rows):
            high = b
        else:
            low = a
    return (low + high) / 2


def fit(rows: Sequence[Row], predictor: Predictor = predict) -> dict[Any, float]:
    """Efficiencies per (chip, precision), per chip, and ``"all"``, each fitted on the rows it covers."""
    fitted: dict[Any, float] = {"all": _best(rows, predictor)}
    for chip in {r.chip for r in rows}:
        fitted[chip] = _best([r for r in rows if r.chip == chip], predictor)
    for key in {r.key for r in rows}:
        fitted[key] = _best([r for r in rows if r.key == key], predictor)
    return fitted


def efficiency_for(row: Row, fitted: dict[Any, float]) -> tuple[float, str]:
    """The fitted efficiency a row is predicted with, and which fit it came from."""
    if row.key in fitted:
        return fitted[row.key], "chip and precision"
    if row.chip in fitted:
        return fitted[row.chip], "chip"
    return fitted["all"], "all rows"


@dataclass
class Fold:
    """One source group left out: its rows' errors with the others' fit, and with the fit over all rows."""

    group: str
    rows: list[Row]
    out_of_sample: list[float]
    in_sample: list[float]
    fallbacks: int

    @staticmethod
    def mean(errors: list[float]) -> float:
        return sum(errors) / len(errors) if errors else math.nan


def _relative(row: Row, efficiency: float, predictor: Predictor) -> float:
    return abs(predictor(row, efficiency) / row.published_step_s - 1.0)


def leave_one_source_out(rows: Sequence[Row], predictor: Predictor = predict) -> list[Fold]:
    usable = [r for r in rows if r.problem is None]
    everything = fit(usable, predictor)
    folds = []
    for group in sorted({r.group for r in usable}):
        held = [r for r in usable if r.group == group]
        others = fit([r for r in usable if r.group != group], predictor)
        chosen = [efficiency_for(r, others) for r in held]
        folds.append(
            Fold(
                group,
                held,
                [_relative(r, e, predictor) for r, (e, _) in zip(held, chosen, strict=True)],
                [_relative(r, efficiency_for(r, everything)[0], predictor) for r in held],
                sum(how != "chip and precision" for _, how in chosen),
            )
        )
    return folds


def markdown(rows: Sequence[Row], folds: Sequence[Fold]) -> str:
    lines = [
        "| source (left out) | rows | step-time error, out of sample | in sample | rows predicted with a fallback fit |",
        "|---|---|---|---|---|",
    ]
    for fold in folds:
        lines.append(
            f"| {fold.group} | {len(fold.rows)} | {100 * Fold.mean(fold.out_of_sample):.1f}%"
            f" | {100 * Fold.mean(fold.in_sample):.1f}% | {fold.fallbacks} |"
        )
    out = [e for f in folds for e in f.out_of_sample]
    ins = [e for f in folds for e in f.in_sample]
    lines.append(
        f"| **all** | {len(out)} | **{100 * Fold.mean(out):.1f}%** | {100 * Fold.mean(ins):.1f}% | |"
    )
    left: dict[str, list[str]] = {}
    for row in rows:
        if row.problem is not None:
            left.setdefault(row.problem, []).append(row.source)
    lines += ["", f"Left out, {sum(len(v) for v in left.values())} rows:", ""]
    lines += [
        f"- {why} ({len(sources)}: {', '.join(sorted(set(sources)))})"
        for why, sources in sorted(left.items())
    ]
    return "\n".join(lines)


_BEGIN, _END = "<!-- validation table: begin -->", "<!-- validation table: end -->"
ERRORS = Path(__file__).with_name("validation_errors.json")
"""The out-of-sample errors by kind of row, written with the table: what ``plan --search`` quotes."""


def errors_by_kind(folds: Sequence[Fold]) -> dict[str, dict[str, float]]:
    """Mean out-of-sample error and row count per ``"chip/precision"``, per ``"chip"`` and over ``"all"`` rows."""
    kinds: dict[str, list[float]] = {}
    for fold in folds:
        for row, error in zip(fold.rows, fold.out_of_sample, strict=True):
            for kind in (f"{row.chip}/{row.precision}", row.chip, "all"):
                kinds.setdefault(kind, []).append(error)
    return {k: {"rows": len(v), "out_of_sample": round(Fold.mean(v), 6)} for k, v in sorted(kinds.items())}


def expected_error(chip: str, precision: str) -> str:
    """How sure a prediction on ``chip`` in Trainer ``precision`` is: the validation's error for the nearest kind of
    published row (its chip and precision, else its chip, else all rows), as one line."""
    kinds = json.loads(ERRORS.read_text())
    chip = ARCHITECTURES.get(chip, chip)  # a variant's rows are fitted and counted as its chip's
    wanted = "fp8" if "fp8" in precision else "16-bit"
    for kind in (f"{chip}/{wanted}", chip, "all"):
        if kind in kinds:
            found = kinds[kind]
            what = "published rows of every kind" if kind == "all" else f"published rows on {kind}"
            note = (
                "" if precision != "32-true" else " (published runs are 16-bit or fp8; 32-true is less sure)"
            )
            return (
                f"expected step-time error: {100 * found['out_of_sample']:.0f}% mean, out of sample, over the"
                f" {found['rows']} {what} (docs/planner.md, leave one source out){note}"
            )
    return "expected step-time error: unknown (no validation data)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="put the table in docs/planner.md")
    args = parser.parse_args(argv)
    rows = load_rows()
    folds = leave_one_source_out(rows)
    every_release = [e for f in leave_one_source_out(load_rows(latest_only=False)) for e in f.out_of_sample]
    table = markdown(rows, folds)
    table += (
        f"\n\nCounting every release's figure of a run its publisher measured again ({len(every_release)} rows):"
        f" {100 * Fold.mean(every_release):.1f}% out of sample."
    )
    print(table)
    if args.write:
        ERRORS.write_text(json.dumps(errors_by_kind(folds), indent=1) + "\n")
        doc = Path(__file__).parents[2] / "docs" / "planner.md"
        text = doc.read_text()
        start, end = text.index(_BEGIN) + len(_BEGIN), text.index(_END)
        doc.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
