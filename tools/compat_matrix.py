"""Write ``docs/compatibility.md`` from the tests' coverage declarations: ``python -m tools.compat_matrix``.

The page is generated, never edited, so it cannot claim what no test checks: pytest collects the
test files (collection only), every test marked ``compat`` contributes the pairs of rows its parity
run holds and every test marked ``compat_refused`` its refused pair (``tests/compat.py`` defines the
rows and the markers). A declaration counts only if its test **passed** in the run recorded in
``docs/compat_results.json`` (``tests/compat_results.py``); ``--run`` runs the declaring tests with
that record switched on, then writes the page. ``--check`` compares instead of writing and exits 1
when the committed page is stale (``tests/test_compat_matrix.py`` runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import itertools
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "compatibility.md"
RESULTS = ROOT / "docs" / "compat_results.json"
MAX_TESTS_SHOWN = 3


@dataclass
class Matrix:
    """What the collected tests say about each pair (a ``frozenset`` of two rows)."""

    tested: dict[frozenset[str], list[str]] = field(default_factory=dict)  # pair -> test node ids
    refused: dict[frozenset[str], list[tuple[str, str]]] = field(
        default_factory=dict
    )  # -> (message, node id)
    zoo: dict[tuple[str, str], tuple[str | None, str]] = field(
        default_factory=dict
    )  # (family, layout) -> (refusal message or None, node id)
    unproven: dict[frozenset[str], list[str]] = field(default_factory=dict)  # declared, not passed
    run: dict[str, str] = field(default_factory=dict)  # the recorded run: torch version, date

    def add_tested(self, pairs: Iterable[frozenset[str]], nodeid: str) -> None:
        for pair in pairs:
            self.tested.setdefault(pair, []).append(nodeid)

    def add_refused(self, pair: frozenset[str], message: str, nodeid: str) -> None:
        self.refused.setdefault(pair, []).append((message, nodeid))


class _Collector:
    """pytest plugin: read the coverage markers of every collected item."""

    def __init__(self) -> None:
        self.matrix = Matrix()
        self.errors: list[str] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(f"{report.nodeid}: {report.longreprtext}")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        for item in session.items:
            try:
                self._read(item)
            except Exception as error:  # every bad declaration is reported, not just the first
                self.errors.append(f"{item.nodeid}: {error}")

    def _read(self, item: pytest.Item) -> None:
        from tests.compat import ROWS, case_features, pairs_of

        for mark in item.iter_markers("compat"):
            if "features" in mark.kwargs:
                features = frozenset(mark.kwargs["features"])
                unknown = features - set(ROWS)
                if unknown:
                    raise ValueError(f"compat(features=...) names unknown rows {sorted(unknown)}")
                self.matrix.add_tested(pairs_of(features), item.nodeid)
                continue
            for case in mark.kwargs.get("cases") or [_parametrized_case(item)]:
                self.matrix.add_tested(pairs_of(case_features(case)), item.nodeid)
        for mark in item.iter_markers("zoo"):
            key = (mark.kwargs["family"], mark.kwargs["layout"])
            self.matrix.zoo[key] = (mark.kwargs.get("refused"), item.nodeid)
        for mark in item.iter_markers("compat_refused"):
            pair = frozenset(mark.kwargs["pair"])
            if len(pair) != 2 or not pair <= set(ROWS):
                raise ValueError(f"compat_refused(pair={mark.kwargs['pair']!r}) is not a pair of rows")
            self.matrix.add_refused(pair, mark.kwargs["message"], item.nodeid)


def _parametrized_case(item: pytest.Item):  # -> Case
    from tests.distributed.cases import CASES, Case

    params = getattr(getattr(item, "callspec", None), "params", {})
    if isinstance(params.get("case"), Case):
        return params["case"]
    if isinstance(params.get("name"), str) and params["name"] in CASES:
        return CASES[params["name"]]
    raise ValueError(
        "@pytest.mark.compat without arguments needs a `case` (Case) or `name` (CASES key) parameter;"
        " pass cases=[...] or features=(...) otherwise"
    )


def _test_files() -> list[str]:
    """Test files that mention the markers (a file that does not cannot declare coverage)."""
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    return [
        str(f.relative_to(ROOT)) for f in files if "compat" in f.read_text() or "mark.zoo" in f.read_text()
    ]


def collect() -> Matrix:
    """Collect the marked tests (nothing runs) and return what they declare."""
    collector = _Collector()
    args = [
        "--collect-only",
        "-o",
        "addopts=",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:terminal",
        "--rootdir",
        str(ROOT),
    ]
    cwd = os.getcwd()
    os.chdir(ROOT)  # node ids relative to the repository, wherever the tool is run from
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            code = pytest.main([*args, *_test_files()], plugins=[collector])
    finally:
        os.chdir(cwd)
    if collector.errors or code not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise SystemExit(
            "compat_matrix: collection failed:\n" + "\n".join(collector.errors or [f"exit {code}"])
        )
    return collector.matrix


def proven(matrix: Matrix, results: dict) -> Matrix:
    """Only what a test that passed in the recorded run declared; the rest of ``tested`` as ``unproven``."""
    passed = set(results.get("passed", []))
    out = Matrix(run={k: str(results.get(k, "")) for k in ("torch", "date")})
    for pair, nodeids in matrix.tested.items():
        good = [n for n in nodeids if n in passed]
        if good:
            out.tested[pair] = good
        else:
            out.unproven[pair] = nodeids
    for pair, entries in matrix.refused.items():
        good_refusals = [(m, n) for m, n in entries if n in passed]
        if good_refusals:
            out.refused[pair] = good_refusals
    out.zoo = {k: v for k, v in matrix.zoo.items() if v[1] in passed}
    return out


def read_results(path: Path) -> dict:
    import json

    return json.loads(path.read_text()) if path.exists() else {}


def run_declaring_tests(results: Path) -> int:
    """Every test file that declares coverage, with the outcomes recorded in ``results``."""
    import subprocess

    from tests.compat_results import ENV

    env = {**os.environ, ENV: str(results)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *_test_files()], cwd=ROOT, env=env
    ).returncode


# ---- the page ---------------------------------------------------------------------------------


def _all_pairs() -> list[frozenset[str]]:
    from tests.compat import EXCLUSIVE, ROWS

    return [
        frozenset(p)
        for p in itertools.combinations(ROWS, 2)
        if not any(frozenset(p) <= group for group in EXCLUSIVE)
    ]


def _ordered(pair: frozenset[str]) -> tuple[str, str]:
    from tests.compat import ROWS

    a, b = sorted(pair, key=ROWS.index)
    return a, b


def _link(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    return f"[`{name}`](../{path})"


def _tests_cell(nodeids: list[str]) -> str:
    unique = sorted(set(nodeids))
    shown = ", ".join(_link(n) for n in unique[:MAX_TESTS_SHOWN])
    more = len(unique) - MAX_TESTS_SHOWN
    return shown + (f" (+{more} more)" if more > 0 else "")


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(matrix: Matrix) -> str:
    from tests.compat import ROWS

    pairs = _all_pairs()
    tested = [p for p in pairs if p in matrix.tested]
    refused = [p for p in pairs if p in matrix.refused and p not in matrix.tested]
    gaps = [p for p in pairs if p not in matrix.tested and p not in matrix.refused]
    unproven = [p for p in gaps if p in matrix.unproven]
    valid = set(pairs)

    def symbol(a: str, b: str) -> str:
        if a == b:
            return "—"
        pair = frozenset((a, b))
        if pair not in valid:
            return ""
        if pair in matrix.tested:
            return "✓*" if pair in matrix.refused else "✓"
        return "✗" if pair in matrix.refused else "**?**"

    lines = [
        "# Compatibility matrix",
        "",
        "<!-- Generated by `python -m tools.compat_matrix` from the tests; do not edit by hand. -->",
        "",
        "Generated from the tests by `python -m tools.compat_matrix --run`: a cell counts only from a test that"
        f" passed in the recorded run (`docs/compat_results.json`: torch {matrix.run.get('torch') or '?'},"
        f" {matrix.run.get('date') or 'no run recorded'});",
        "`tests/test_compat_matrix.py` fails when this page differs from what the tests declare.",
        'How a test declares what it covers: [testing.md, "Declaring coverage"](testing.md#declaring-coverage).',
        "",
        "- **✓ tested**: a test asserts parity with the single-process run for a layout holding both",
        "  rows. Two layout rows count only from an fp32 run (losses within 1e-5 per step, every final",
        "  parameter); a pair with a low precision from a run in that precision on a learnable sequence (losses and"
        " every parameter within the tolerance measured on the one-process run, every randomly initialised parameter"
        ' moved ten of its tolerances: docs/testing.md, "Low precision"). Every run computes each matrix product'
        ' in its precision\'s dtype (docs/testing.md, "Compute dtype").',
        "- **✗ refused**: the strategy refuses the pair at setup with a `ValueError`, and a test asserts it.",
        "  **✓\\*** : tested, and refused in some settings (see the refused list).",
        "- **?** **gap**: neither tested nor refused: untested, use at your own risk.",
        "- blank: two values of one argument (one ZeRO stage, schedule, checkpointing mode, precision);",
        "  `—`: the same row.",
        "",
        "Rows: `dp` = every parameter has more than one data-parallel replica (world / (tp x pp x ep) > 1);",
        "`sp` = sequence parallelism (with tp > 1); `pp=<schedule>` = pipeline parallelism with that",
        "schedule; `ac=` = activation checkpointing mode; `32-true` ... `fp8` = the precision",
        "(`fp8`: `lightning_parallel.precision.fp8.Float8Precision`). `16-mixed` (fp16 autocast with loss",
        'scaling) runs on the CPU through `MixedPrecision("16-mixed", "cpu")` (the flag alone becomes `bf16-mixed`',
        "there). `fp8` runs in torchao's emulation (`tests/distributed/test_parity_fp8.py`), but its scaling noise",
        "leaves every weight 2-4 tolerances of movement, so its runs count nowhere here.",
        "",
        f"**{len(pairs)} pairs: {len(tested)} tested, {len(refused)} refused, {len(gaps)} gaps.**",
        "",
        "| | " + " | ".join(f"`{r}`" for r in ROWS) + " |",
        "|---" * (len(ROWS) + 1) + "|",
    ]
    for a in ROWS:
        lines.append(f"| `{a}` | " + " | ".join(symbol(a, b) for b in ROWS) + " |")

    lines += ["", f"## Tested ({len(tested)})", "", "| pair | tests |", "|---|---|"]
    for pair in sorted(tested, key=lambda p: [ROWS.index(r) for r in _ordered(p)]):
        a, b = _ordered(pair)
        lines.append(f"| `{a}` x `{b}` | {_tests_cell(matrix.tested[pair])} |")

    all_refused = sorted(
        (p for p in pairs if p in matrix.refused), key=lambda p: [ROWS.index(r) for r in _ordered(p)]
    )
    lines += [
        "",
        f"## Refused ({len(refused)})",
        "",
        "| pair | error message (start) | test |",
        "|---|---|---|",
    ]
    for pair in all_refused:
        a, b = _ordered(pair)
        note = " (tested in other settings)" if pair in matrix.tested else ""
        for message, nodeid in sorted(set(matrix.refused[pair])):
            lines.append(f"| `{a}` x `{b}`{note} | {_escape(message)} | {_link(nodeid)} |")

    lines += ["", f"## Gaps: untested ({len(gaps)})", ""]
    by_row: dict[str, list[str]] = {}
    for pair in gaps:
        a, b = _ordered(pair)
        by_row.setdefault(a, []).append(b)
    for a in ROWS:
        if a in by_row:
            lines.append(f"- `{a}` with " + ", ".join(f"`{b}`" for b in by_row[a]))
    if not gaps:
        lines.append("None.")
    if unproven:
        lines += [
            "",
            f"Of these, {len(unproven)} are declared by a test that did not pass in the recorded run:",
            "",
        ]
        for pair in sorted(unproven, key=lambda p: [ROWS.index(r) for r in _ordered(p)]):
            a, b = _ordered(pair)
            lines.append(f"- `{a}` x `{b}`: {_tests_cell(matrix.unproven[pair])}")
    from tools.hf_sweep_report import section

    return "\n".join(lines + _zoo_section(matrix) + section()) + "\n"


def _zoo_section(matrix: Matrix) -> list[str]:
    """The per-family table: each family of tests/models/zoo.py, each layout it was tried in."""
    from tests.models.zoo import ZOO

    if not matrix.zoo:
        return []
    layouts = list(dict.fromkeys(layout for _, layout in sorted(matrix.zoo, key=lambda k: k[1])))
    layouts.sort(key=lambda name: ("tp2", "tp2+sp", "pp2", "ep2", "tp4", "tp2 x dp2").index(name) if name in
                 ("tp2", "tp2+sp", "pp2", "ep2", "tp4", "tp2 x dp2") else 99)  # fmt: skip
    works = sum(1 for refused, _ in matrix.zoo.values() if refused is None)
    lines = [
        "",
        "## Model families",
        "",
        "Unchanged Hugging Face causal LMs built from tiny configs (`tests/models/zoo.py`), each against the same",
        "module in one process: ✓ trains at fp32 parity (losses within 1e-5 per step, every final parameter),",
        "✗ refused at setup with the message below; blank: not tried. Beside these, the parity suites train",
        "GPT-2, Llama, OPT, Qwen3, Mixtral and GPT-OSS (`tests/models/hf.py`) in the layouts of the matrix above.",
        "",
        f"**{len(matrix.zoo)} family x layout runs: {works} train at parity, {len(matrix.zoo) - works} refused.**",
        "",
        "| family | what sets it apart | " + " | ".join(f"`{layout}`" for layout in layouts) + " |",
        "|---|---|" + "---|" * len(layouts),
    ]
    for family, spec in ZOO.items():
        cells = []
        for layout in layouts:
            entry = matrix.zoo.get((family, layout))
            cells.append("" if entry is None else "✓" if entry[0] is None else "✗")
        lines.append(f"| `{family}` | {_escape(spec.trait)} | " + " | ".join(cells) + " |")
    refused = sorted((k, v) for k, v in matrix.zoo.items() if v[0] is not None)
    if refused:
        lines += ["", "| refused | message (start) | test |", "|---|---|---|"]
        for (family, layout), (message, nodeid) in refused:
            lines.append(f"| `{family}` `{layout}` | {_escape(message or '')} | {_link(nodeid)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed page; exit 1 if stale"
    )
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--results", type=Path, default=RESULTS, help="the recorded run's outcomes")
    parser.add_argument(
        "--run", action="store_true", help="run every declaring test first, recording into --results"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.run:
        print(f"tests ended with exit code {run_declaring_tests(args.results)}; failures count as not passed")
    page = render(proven(collect(), read_results(args.results)))
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != page:
            diff = difflib.unified_diff(
                current.splitlines(), page.splitlines(), "committed", "from the tests", n=0, lineterm=""
            )
            print(
                f"{args.output} is stale: run `python -m tools.compat_matrix` and commit it.\n"
                + "\n".join(list(diff)[:40]),
                file=sys.stderr,
            )
            return 1
        print(f"{args.output} is up to date.")
        return 0
    args.output.write_text(page)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
