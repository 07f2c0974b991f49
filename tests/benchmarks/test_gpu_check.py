"""The GPU check's driver: phases cut to the deadline, stopped at their limit, skipped when time is out.

Made-up phases (``python -m timeit``) stand in for the measurements, so the logic runs in seconds;
``GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh`` runs the real phases on tiny shapes (benchmarks/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import MARGIN_S, Figure, Phase


def test_phases_fit_the_deadline_and_what_ran_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made_up = [
        Phase("environment", ["benchmarks.gpu_check", "--environment", "{json}"], 60,
              [Figure("python 3", lambda r: r["python"].split(".")[0], "==", "3", "x"),
               Figure("torch is older than 1", lambda r: int(r["torch"].split(".")[0]), "<=", 0, "y"),
               Figure("absent", lambda r: r["no such key"], "==", 1, "z")]),
        Phase("slow", ["timeit", "-n", "1", "-r", "1", "import time; time.sleep(60)"], 12),
        Phase("late", ["timeit", "pass"], 60),
        Phase("missing", ["timeit", "pass"], 60, needs="no_such_module_anywhere"),
    ]  # fmt: skip
    monkeypatch.setattr(gpu_check, "phases", lambda dry_run, device=None: made_up)
    report = gpu_check.run(tmp_path, deadline_s=MARGIN_S + 40, dry_run=True)
    status = {p["phase"]: p["status"] for p in report["phases"]}
    assert status == {
        "environment": "passed",
        "slow": "stopped at its limit of 12 s",
        "late": "skipped: the deadline",
        "missing": "skipped: no_such_module_anywhere is not installed",
    }
    assert not report["ok"]  # a stopped phase fails the check
    verdicts = [f["verdict"] for f in report["phases"][0]["figures"]]
    assert verdicts == ["pass", "miss", "not measured"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["phases"][0]["results"]["python"].startswith(
        "3."
    )
    assert "timeit" in (tmp_path / "gpu_check.txt").read_text()


def test_the_real_check_runs_the_most_valuable_first_within_one_command() -> None:
    for dry_run in (False, True):
        real = gpu_check.phases(dry_run)
        assert [p.name for p in real][:4] == ["environment", "engines_deepspeed", "offload", "memory"]
        assert all(p.limit_s <= gpu_check.DEADLINE_S for p in real) and gpu_check.DEADLINE_S <= 9 * 60
    assert [p.name for p in gpu_check.selected(False, None, quick=True)] == list(gpu_check.QUICK)
    assert gpu_check.QUICK_DEADLINE_S <= 5 * 60
    everything = [p.name for p in gpu_check.selected(False, None, quick=False)]
    assert "step" not in everything and "largest" in everything  # on request only: eager vs Lightning
    assert [p.name for p in gpu_check.selected(False, ["step"], quick=False)] == ["environment", "step"]


def test_every_engine_is_judged_against_eager_with_the_dtype_it_computed_in() -> None:
    """The first GPU run's ZeRO-2 read "pass" against our own offload path while both ran in fp32."""
    from benchmarks.zero_engines import GROUPS

    figures = {f.name: f for p in gpu_check.phases(False) for f in p.figures}
    for engines in GROUPS.values():
        for engine in engines:
            assert figures[f"{engine} / eager step time"].compare == "<="
            assert figures[f"{engine}: bf16 share of Linear outputs"].value == 1.0
            assert f"{engine}: peak memory / planner" in figures
    share = figures["deepspeed zero2: bf16 share of Linear outputs"]
    fp32_run = {"figures": {"deepspeed zero2": {"bf16_share": 0.0}}}
    assert share.check(fp32_run)["verdict"] == "miss"  # an fp32 step fails the check


def test_the_lent_chip_read_in_the_first_phase_judges_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call naming no kind is lent an H100: the phases after the environment are judged for that chip."""
    seen = tmp_path / "seen.json"
    seen.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3"}))

    def made_up(dry_run: bool, device: str | None = None) -> list[Phase]:
        copy = ["json.tool", str(seen), "{json}"]  # stands in for the environment phase on a lent H100
        return [Phase("environment", copy, 60),
                Phase("measure", copy, 60, [Figure("chip known", lambda r, d=device: d, "==", "NVIDIA H100 80GB HBM3",
                                                   "x")])]  # fmt: skip

    monkeypatch.setattr(gpu_check, "phases", made_up)
    report = gpu_check.run(tmp_path, deadline_s=MARGIN_S + 100, dry_run=False)
    assert report["device"] == "NVIDIA H100 80GB HBM3"
    assert report["phases"][1]["figures"][0]["verdict"] == "pass"  # built again with the chip


def test_the_h200_references_are_judged_on_an_h200_and_shown_on_an_h100() -> None:
    assert gpu_check.planner_preset("NVIDIA H200") == "h200"
    assert gpu_check.planner_preset("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_check.planner_preset("NVIDIA A100-SXM4-80GB") is None

    def figures(device: str) -> dict[str, Figure]:
        return {f.name: f for p in gpu_check.phases(False, device) for f in p.figures}

    on_h200, on_h100 = figures("NVIDIA H200"), figures("NVIDIA H100 80GB HBM3")
    compiled = {"results": {"compile": {"times": [0.400]}}}  # 400 ms: an H200 this slow misses
    assert on_h200["compile GPT-1.3B ms/step"].check(compiled)["verdict"] == "miss"
    assert on_h100["compile GPT-1.3B ms/step"].check(compiled)["verdict"] == "reported"
    step = "none recomputation: measured / predicted step time"
    assert "h100 preset" in on_h100[step].source and "h200 preset" in on_h200[step].source
    # the presets predict different times (HBM3 vs HBM3e): the H200's prediction would misjudge an H100
    h100, h200 = gpu_check.planned(cluster="h100"), gpu_check.planned(cluster="h200")
    assert h100["none"]["step_s"] > h200["none"]["step_s"]
    # ratios against eager are judged on every chip
    assert on_h100["deepspeed zero2 / eager step time"].compare == "<="
    unknown = figures("NVIDIA A100-SXM4-80GB")
    assert unknown[step].compare == "report"
