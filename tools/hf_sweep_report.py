"""The family sweep's table (``tools/hf_sweep.py``) as Markdown, from its results file ``docs/hf_sweep.json``.

``python -m tools.compat_matrix`` appends it to ``docs/compatibility.md``, so the page shows what the last
sweep found, on the ``transformers`` version it ran on; the sweep regenerates the page when it ends.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "hf_sweep.json"
COLUMNS = ("tp2", "tp2+sp", "pp2", "ep2")
MESSAGE_CHARS = 240


def kind(row: str | None) -> str:
    """``parity``, ``refused``, ``mismatch`` (trained, but not like one process), ``unjudged`` (the one-process
    fp32 run is itself further than the rule from float64), ``failed`` or ``""``."""
    if not row:
        return ""
    if row == "parity":
        return "parity"
    if row.startswith("failed: mismatch"):
        return "mismatch"
    return row.split(":", 1)[0]


_SYMBOL = {"parity": "✓", "refused": "✗ R", "failed": "✗ F", "mismatch": "✗ **M**", "unjudged": "?", "": ""}


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def counts(data: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per column: how many families at parity, refused, failed, mismatched; ``of``: how many it applies to."""
    table: dict[str, dict[str, int]] = {}
    for column in COLUMNS:
        tally = {"parity": 0, "refused": 0, "failed": 0, "mismatch": 0, "unjudged": 0, "of": 0}
        for entry in data.get("families", {}).values():
            row_kind = kind(entry.get(column))
            if row_kind:
                tally[row_kind] += 1
                tally["of"] += 1
        table[column] = tally
    return table


def render(data: dict[str, Any]) -> list[str]:
    """The section's lines (empty without results)."""
    families = data.get("families", {})
    if not families:
        return []
    lines = [
        "",
        "## Every decoder family of `transformers` (the sweep)",
        "",
        f'`python -m tools.hf_sweep` (docs/testing.md, "The family sweep"), last run {data.get("date", "?")} on'
        f" transformers {data.get('transformers', '?')}, torch {data.get('torch', '?')}: every decoder-only"
        " `model_type` of the causal-LM mapping, unchanged, from a tiny config of its own defaults"
        " (`tests/models/tiny_configs.py`: width 64, 4 query heads, 2-4 layers holding every kind of layer it"
        " mixes, vocabulary 128, no dropout, eager attention), 3 SGD steps in one process and in two: ✓ fp32"
        " parity (losses within 1e-5 per step, every final parameter), ✗ R refused at setup with the message"
        " below, ✗ F failed (error below), ✗ **M** trained but did not match (a silent mismatch), ? not judged:"
        " the one-process fp32 run is itself further than the rule from the same run in float64 (the tiny model"
        " amplifies rounding; both spreads are in the message); `ep2` (expert"
        " parallelism over both data-parallel ranks) only for families with experts. Families that need"
        " `trust_remote_code` are not in the mapping, so not here.",
        "",
    ]
    tally = counts(data)
    summary = []
    for column in COLUMNS:
        t = tally[column]
        if t["of"]:
            share = 100 * t["parity"] / t["of"]
            summary.append(
                f"`{column}` {t['parity']}/{t['of']} at parity ({share:.0f}%), {t['refused']} refused,"
                f" {t['failed']} failed, {t['mismatch']} mismatched, {t['unjudged']} not judged"
            )
    lines += [f"**{len(families)} families:** " + "; ".join(summary) + ".", ""]
    lines += ["| family | layers it mixes | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |",
              "|---|---|" + "---|" * len(COLUMNS)]  # fmt: skip
    for name in sorted(families):
        entry = families[name]
        cells = [_SYMBOL[kind(entry.get(c))] if c != "ep2" or entry.get("moe") else "—" for c in COLUMNS]
        traits = ("MoE; " if entry.get("moe") else "") + entry.get("kinds", "")
        lines.append(f"| `{name}` | {_escape(traits)} | " + " | ".join(cells) + " |")
    problems = [(n, c, families[n][c]) for n in sorted(families) for c in COLUMNS
                if kind(families[n].get(c)) not in ("", "parity")]  # fmt: skip
    if problems:
        lines += ["", "| family | layout | refused or failed: message (start) |", "|---|---|---|"]
        for name, column, row in problems:
            text = row if len(row) <= MESSAGE_CHARS else row[: MESSAGE_CHARS - 3] + "..."
            lines.append(f"| `{name}` | `{column}` | {_escape(text)} |")
    left_out = data.get("left_out", {})
    if left_out:
        reasons: dict[str, list[str]] = {}
        for name, why in sorted(left_out.items()):
            reasons.setdefault(why, []).append(f"`{name}`")
        lines += ["", "Not decoder families, so not swept:"]
        lines += [f"- {why}: {', '.join(names)}" for why, names in reasons.items()]
    return lines


def load(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def section(path: Path = RESULTS) -> list[str]:
    """What ``tools/compat_matrix.py`` appends to the page."""
    return render(load(path))
