"""Every decoder family of the installed ``transformers``, unchanged, under tp2, tp2+sp, pp2 and ep2.

    nice -n 10 python -m tools.hf_sweep                       # every family not yet in the results file
    python -m tools.hf_sweep --families llama,gemma3n_text    # only these (resumes the others' rows)
    python -m tools.hf_sweep --retry failed,refused --limit 10   # run those rows again, ten families
    python -m tools.hf_sweep --report                         # the table only, from the results file

Each family of the causal-LM mapping that is a decoder (``tests/models/tiny_configs.py`` says which, and
why the others are left out; families that need ``trust_remote_code`` are not in the mapping) is built
from a tiny config of its own defaults and trained through the real ``lightning.Trainer`` by the parity
harness (``tests/distributed/harness.py``): one process (the reference), then two processes under each
layout, 3 SGD steps, compared at the fp32 parity rule (losses within 1e-5 per step and every final
parameter). ``ep2`` (expert parallelism over the two data-parallel ranks) only for families whose config
has experts. Each row is ``parity``, ``refused: <the setup error: module and reason>`` or ``failed:
<error>`` (``failed: mismatch: ...``: it trained, but not like one process; ``failed: timed out``: a hang,
killed after ``--timeout`` seconds per run and reported).

The results file (``docs/hf_sweep.json``) is written after every row, so a sweep killed half-way resumes
where it stopped; ``python -m tools.compat_matrix`` renders it as the family table of
``docs/compatibility.md`` (with the ``transformers`` version it ran on), which this command regenerates at
the end (``--no-doc`` skips that). A sweep imports this project once per invocation (the harness's warm
workers): run it again, or in chunks (``--limit``), to test changed code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "hf_sweep.json"
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel": 2},
    "tp2+sp": {"tensor_parallel": 2, "sequence_parallel": True},
    "pp2": {"pipeline_parallel": 2},
    "ep2": {"expert_parallel": 2},
}
STEPS = 3
PARITY_RTOL = 1e-5  # the fp32 rule (tests/distributed/cases.py, RTOL)
NOISE_FACTOR = 4  # a layout further from one process than this many times the control's spread is a mismatch
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|DistBackendError|gloo|Broken pipe|timed out", re.I)


def case_for(family: str, layout: str) -> Any:
    """The harness case of one row: ``family`` from its tiny config under ``layout`` on two processes."""
    from tests.distributed.cases import Case, StrategySpec

    kwargs = {"tensor_parallel": 1, "pipeline_parallel": 1, **LAYOUTS[layout]}
    dp = 2 // (kwargs["tensor_parallel"] * kwargs["pipeline_parallel"])
    spec = StrategySpec("lightning_parallel:HybridParallelStrategy", kwargs)
    name = f"sweep_{family}_{layout.replace('+', '_')}"
    return Case(name, "hf_tiny", spec, world_size=2, data_parallel=dp, steps=STEPS,
                model_kwargs={"model_type": family})  # fmt: skip


def exception_text(traceback_text: str) -> tuple[str, bool]:
    """The final exception of a traceback (``Type: message``) and whether our code raised it."""
    lines = traceback_text.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return (lines[-1] if lines else "<no traceback>"), False
    last = frames[-1]
    ours = "lightning_parallel/" in lines[last]
    rest = [line for line in lines[last + 1 :] if not line.startswith("    ")]
    return " ".join(" ".join(rest).split()), ours


def describe_failure(message: str, directory: Path | None) -> tuple[str | None, str]:
    """``(case name, row text)`` of a failed launch: the rank whose own error came first, not a peer that
    only lost its connection to it."""
    errors = sorted(directory.glob("error.rank*.txt"), key=lambda p: p.stat().st_mtime) if directory else []
    texts = [p.read_text() for p in errors]
    own = [t for t in texts if not PEER_LOST.search(exception_text(t)[0])] or texts
    if not own:
        reason = message.splitlines()[0] if message else "unknown"
        if "timed out" in reason:
            return None, f"failed: timed out ({reason.split(': ', 1)[-1]})"
        return None, f"failed: {reason}"
    first = own[0]
    header = re.match(r"rank \d+, case (\S+?)( \(reference\))?:", first)
    text, ours = exception_text(first)
    kind = "refused" if ours and re.match(r"(\w+\.)*(ValueError|PipelineSetupError)\b", text) else "failed"
    text = re.sub(r"^(\w+\.)*(ValueError|PipelineSetupError): ", "", text) if kind == "refused" else text
    return (header.group(1) if header else None), f"{kind}: {text}"


def run_two_process(cases: list[Any], timeout_s: float) -> dict[str, Any]:
    """Each case's :class:`Result`, or its row text when it failed; one launch, relaunched after a failure
    with the cases that had not run."""
    import torch

    from tests.distributed.harness import HarnessError, Result, run_cases

    out: dict[str, Any] = {}
    pending = list(cases)
    while pending:
        try:
            out.update(run_cases(pending, 2, timeout_s=timeout_s * len(pending)))
            break
        except HarnessError as error:
            directory = error.directory
            done = 0
            while directory and (directory / f"result.{done}.pt").exists() and done < len(pending):
                out[pending[done].name] = Result(
                    **torch.load(directory / f"result.{done}.pt", weights_only=True)
                )
                done += 1
            name, row = describe_failure(str(error), directory)
            index = next((i for i, c in enumerate(pending) if c.name == name), done)
            index = max(index, done) if index < len(pending) else done
            if index >= len(pending):
                index = len(pending) - 1
            for case in pending[done:index]:  # ran before the failing one but wrote nothing: not known
                out.setdefault(case.name, f"failed: not run (launch stopped by {pending[index].name})")
            out[pending[index].name] = row
            pending = pending[index + 1 :]
            if directory:
                shutil.rmtree(directory, ignore_errors=True)
    return out


def judge(result: Any, ref: Any) -> str:
    from tests.distributed.harness import assert_parity

    try:
        assert_parity(result, ref)
    except AssertionError as error:
        problems = " ".join(p.lstrip("- ") for p in str(error).splitlines()[1:4])
        if problems.startswith("not engaged"):  # it trained like one process, but the layout did not split it
            return "failed: " + problems
        return "failed: mismatch: " + problems
    return "parity"


def largest_spread(got: Any, want: Any) -> float:
    """The largest relative difference of two runs: per loss, and per parameter as the norm of the difference
    over the reference's norm."""
    losses = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got.losses, want.losses, strict=True)]
    params = [float((got.params[n] - p).norm() / max(float(p.norm()), 1e-30)) for n, p in want.params.items()]
    return max(losses + params)


def with_noise_control(row: str, case: Any, result: Any, ref: Any, timeout_s: float) -> str:
    """A mismatch, told apart from a family the fp32 rule cannot judge: the one-process run again in float64.
    Where the fp32 run is itself further than the rule from it, the tiny model amplifies rounding (a tensor-
    parallel matmul rounds differently from a whole one, as fp32 does from exact arithmetic), and the row
    says so with both spreads instead of a mismatch, unless the layout is ``NOISE_FACTOR`` times further off
    than fp32 itself, or copies of one weight disagree."""
    from tests.distributed.harness import HarnessError, references

    if "out of sync" in row:  # copies of one weight that disagree: wrong whatever the rounding
        return row
    control = case.replace(
        name=f"{case.name}~fp64", trainer_kwargs={**case.trainer_kwargs, "precision": "64-true"}
    )
    try:
        exact = references([control], timeout_s=timeout_s)[control.name]
    except HarnessError as error:  # a kernel without float64 (grouped_mm): the mismatch stands
        if error.directory:
            shutil.rmtree(error.directory, ignore_errors=True)
        return row
    fp32_error, layout = largest_spread(ref, exact), largest_spread(result, ref)
    if fp32_error <= PARITY_RTOL or layout > NOISE_FACTOR * fp32_error:
        return row
    return (
        f"unjudged: the one-process fp32 run is up to {fp32_error:.2g} (relative) from the same run in"
        f" float64, this layout {layout:.2g} from the fp32 run; {row}"
    )


def sweep_family(family: str, layouts: list[str], timeout_s: float) -> dict[str, str]:
    """The rows of one family: references in one process, then the two-process layouts."""
    from tests.distributed.harness import HarnessError, references

    cases = [case_for(family, layout) for layout in layouts]
    try:
        refs = references(cases, timeout_s=timeout_s * len(cases))
    except HarnessError as error:
        _, row = describe_failure(str(error), error.directory)
        if error.directory:
            shutil.rmtree(error.directory, ignore_errors=True)
        return {
            layout: f"failed: in one process (the reference): {row.split(': ', 1)[-1]}" for layout in layouts
        }
    results = run_two_process(cases, timeout_s)
    rows = {}
    for layout, case in zip(layouts, cases, strict=True):
        got = results.get(case.name, "failed: no result")
        rows[layout] = got if isinstance(got, str) else judge(got, refs[case.name])
        if rows[layout].startswith("failed: mismatch") and not isinstance(got, str):
            rows[layout] = with_noise_control(rows[layout], case, got, refs[case.name], timeout_s)
    return rows


def family_facts(family: str) -> dict[str, Any]:
    """What the table says of a family besides its rows: MoE or not, the kinds of layers it mixes."""
    from tests.models.tiny_configs import is_moe, tiny_config

    try:
        config = tiny_config(family)
    except Exception as error:  # noqa: BLE001 - its rows say "failed" with this reason
        return {"moe": False, "kinds": "", "config_error": f"{type(error).__name__}: {error}"[:300]}
    kinds = sorted({str(k) for key in ("layer_types", "layers_block_type", "mlp_layer_types", "block_types")
                    for k in (getattr(config, key, None) or []) if isinstance(k, str)})  # fmt: skip
    return {"moe": is_moe(config), "kinds": ", ".join(kinds)}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"families": {}, "left_out": {}}


def save(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def wanted(row: str | None, retry: set[str]) -> bool:
    if row is None:
        return True
    kind = "parity" if row == "parity" else row.split(":", 1)[0]
    return (
        kind in retry
        or "all" in retry
        or (kind == "failed" and row.startswith("failed: mismatch") and "mismatch" in retry)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: every decoder family)")
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS)
    )
    parser.add_argument(
        "--retry", default="", help="run rows again: failed, refused, mismatch, parity or all"
    )
    parser.add_argument("--limit", type=int, default=0, help="at most this many families (0: no limit)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per run before it is killed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report", action="store_true", help="print the table from the results file only")
    parser.add_argument("--no-doc", action="store_true", help="do not regenerate docs/compatibility.md")
    args = parser.parse_args(argv)

    from tools.hf_sweep_report import render

    data = load(args.results)
    if args.report:
        print("\n".join(render(data)))
        return 0
    import torch
    import transformers

    from tests.models.tiny_configs import decoder_families

    transformers.logging.set_verbosity_error()  # each family's defaults warn about their token ids

    families, left_out = decoder_families()
    data.update(transformers=transformers.__version__, torch=torch.__version__, left_out=left_out)
    for gone in [f for f in data["families"] if f in left_out]:  # left out since its rows were run
        del data["families"][gone]
    save(args.results, data)
    chosen = args.families.split(",") if args.families else families
    layouts = [layout for layout in args.layouts.split(",") if layout]
    retry = {r for r in args.retry.split(",") if r}
    done = 0
    for family in chosen:
        entry = data["families"].setdefault(family, {})
        entry.update(family_facts(family))
        if not entry["moe"]:
            entry.pop("ep2", None)  # a row from when the family was taken for an MoE one
        todo = [c for c in layouts if (c != "ep2" or entry["moe"]) and wanted(entry.get(c), retry)]
        if not todo:
            continue
        if args.limit and done >= args.limit:
            break
        done += 1
        start = time.monotonic()
        if "config_error" in entry:
            rows = {layout: f"failed: config: {entry['config_error']}" for layout in todo}
        else:
            rows = sweep_family(family, todo, args.timeout)
        entry.update(rows)
        entry["seconds"] = round(time.monotonic() - start)
        data["date"] = time.strftime("%Y-%m-%d")
        save(args.results, data)
        print(f"{family:24s} " + "  ".join(f"{c}: {rows[c][:70]}" for c in todo), flush=True)
    if not args.no_doc:
        from tools.compat_matrix import main as write_page

        write_page([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
