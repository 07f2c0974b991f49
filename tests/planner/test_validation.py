"""The leave-one-source-out protocol (``planner/validation.py``): which rows each fold fits on, not the
figures it reports. Synthetic rows with a stub predictor (step = work / efficiency) keep it fast; the data
file is checked for what the protocol needs (sources, links, enough expressible rows)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from lightning_parallel.planner.cluster import CLUSTERS
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.micro_batch import Execution
from lightning_parallel.planner.published_rows import _superseded
from lightning_parallel.planner.shapes import ModelShape
from lightning_parallel.planner.timing import step_time
from lightning_parallel.planner.validation import (
    Fold,
    Row,
    efficiency_for,
    fit,
    leave_one_source_out,
    load_rows,
)

# Each source measured the same chip at its own efficiency: work 1 s at efficiency 1.
TRUE = {"mbridge-a": 0.5, "torchtitan-a": 0.35, "korthikanti2022": 0.6}
MEASURED_AT: dict[str, float] = {}  # by row name: the efficiency its run had, wherever the row is filed


def _row(source: str, work: float, chip: str = "h100", precision: str = "16-bit") -> Row:
    name = f"{source} {work} {chip} {precision}"
    MEASURED_AT[name] = TRUE[source]
    return Row(source, name, "url", chip, precision, work / TRUE[source])


def _stub(row: Row, efficiency: float) -> float:
    return row.published_step_s * MEASURED_AT[row.name] / efficiency


ROWS = [_row(s, w) for s in TRUE for w in (1.0, 2.0, 3.0)]


def test_each_fold_is_predicted_with_the_other_groups_fit_only() -> None:
    folds = {f.group: f for f in leave_one_source_out(ROWS, _stub)}
    assert set(folds) == {"NVIDIA NeMo / Megatron-Bridge", "torchtitan", "Korthikanti et al. 2022"}
    titan = folds["torchtitan"]
    others = fit([r for r in ROWS if r.group != "torchtitan"], _stub)[("h100", "16-bit")]
    assert 0.5 <= others <= 0.6  # the others' efficiencies, never torchtitan's 0.35
    for error in titan.out_of_sample:
        assert math.isclose(error, abs(0.35 / others - 1.0), rel_tol=1e-3)
    # the negative control: fitted on every row, torchtitan's own rows pull the fit and its error shrinks
    assert max(titan.in_sample) < min(titan.out_of_sample)


def test_a_row_moved_from_the_validation_to_the_fitting_set_changes_the_reported_error() -> None:
    before = {f.group: f for f in leave_one_source_out(ROWS, _stub)}["torchtitan"]
    moved_name = ROWS[3].name  # a torchtitan row, filed under another group
    moved = [Row("mbridge-a", r.name, "url", r.chip, r.precision, r.published_step_s) if r.name == moved_name
             else r for r in ROWS]  # fmt: skip
    after = {f.group: f for f in leave_one_source_out(moved, _stub)}["torchtitan"]
    assert len(after.rows) == len(before.rows) - 1
    assert Fold.mean(after.out_of_sample) != Fold.mean(before.out_of_sample)


def test_a_chip_and_precision_no_other_group_has_falls_back_and_is_counted() -> None:
    rows = [*ROWS, _row("korthikanti2022", 1.0, chip="a100-80gb")]
    fitted = fit([r for r in rows if r.group != "Korthikanti et al. 2022"], _stub)
    assert efficiency_for(rows[-1], fitted)[1] == "all rows"
    fp8 = _row("mbridge-a", 1.0, precision="fp8")
    assert efficiency_for(fp8, fitted)[1] == "chip"
    fold = {f.group: f for f in leave_one_source_out(rows, _stub)}["Korthikanti et al. 2022"]
    assert fold.fallbacks == 1


def test_the_published_runs_give_the_protocol_five_groups_and_forty_rows() -> None:
    rows = load_rows()
    usable = [r for r in rows if r.problem is None]
    assert len({r.group for r in usable}) >= 5 and len(usable) >= 40
    assert all(r.url and r.source for r in rows)
    assert all(r.published_step_s > 0 for r in usable)
    assert all(r.problem for r in rows if r.setup is None)  # nothing left out without its reason


def test_fp8_projections_run_at_the_fp8_peak_and_pay_their_casts() -> None:
    shape = ModelShape.gpt(
        8, 4096, 32, 32_000, ffn_hidden=14336, kv_heads=8, gated=True, tied_head=False, bias=False
    )
    layout = Layout(micro_batch_size=1, sequence_length=4096, precision="bf16-mixed")
    # fused kernels (Transformer Engine's runs): eager PyTorch's extra passes would dilute what fp8 changes
    plain = step_time(shape, layout, CLUSTERS["h100"], Execution(compiled=True))
    fp8 = step_time(shape, layout, CLUSTERS["h100"], Execution(float8_linears=True, compiled=True))
    # not the whole 2x: attention (its backward scores again), the head and the casts stay; torchtitan measured
    # 0.78 on Llama 3.1 8B (compiled bf16 against compiled Float8, benchmarks/llama3_h100_202412_torchtitan.md)
    assert 0.5 < fp8.total / plain.total < 0.85
    # the negative control: a chip without fp8 tensor cores runs the same step
    a100 = CLUSTERS["a100-80gb"]
    assert (
        step_time(shape, layout, a100, Execution(float8_linears=True)).total
        == step_time(shape, layout, a100, Execution()).total
    )


def _llama_and_gpt() -> tuple[ModelShape, ModelShape, Layout]:
    llama = ModelShape.gpt(
        8, 4096, 32, 32_000, ffn_hidden=14336, kv_heads=8, gated=True, tied_head=False, bias=False
    )
    gpt = ModelShape.gpt(8, 4096, 32, 32_000)
    return llama, gpt, Layout(micro_batch_size=1, sequence_length=4096, precision="bf16-mixed")


def test_eager_pytorch_pays_for_the_unfused_norms_rotary_and_swiglu_of_llama_style_blocks() -> None:
    llama, gpt, layout = _llama_and_gpt()
    h100 = CLUSTERS["h100"]
    compiled, eager = (step_time(llama, layout, h100, Execution(compiled=c)).total for c in (True, False))
    assert 1.03 < eager / compiled < 1.2  # torchtitan measured 1.07-1.16x on Llama 3.1 8B
    # GPT-style blocks: LayerNorm and GELU are single native kernels either way
    assert (
        step_time(gpt, layout, h100, Execution(compiled=False)).total
        == step_time(gpt, layout, h100, Execution(compiled=True)).total
    )


def test_fp8_casts_cost_what_their_recipe_moves() -> None:
    llama, _, layout = _llama_and_gpt()
    h100 = CLUSTERS["h100"]
    steps = [
        step_time(llama, layout, h100, Execution(float8_linears=True, float8_cast_passes=p)).total
        for p in (0.5, 1.5, 2.5)
    ]
    assert steps[0] < steps[1] < steps[2]


def test_rows_carry_what_their_code_did() -> None:
    """torchtitan's rows: eager unless compiled, TP collectives overlapped only with AsyncTP, torchao's fp8 its own
    fitted precision, the 405B pipeline rows in the micro-batches its defaults split the local batch into."""
    rows = [r for r in load_rows() if r.problem is None and r.source.startswith("torchtitan-benchmarks")]
    assert {(r.chip, r.cluster) for r in rows} == {
        ("h100", "h100-hbm2e-500w")
    }  # fitted as H100s, run on their part
    by_note = {(r.name, r.published_step_s): r for r in rows}
    assert {r.precision for r in rows} == {"16-bit", "fp8 (torchao)"}
    eager = [r for r in rows if r.precision == "16-bit" and not r.setup[2].compiled]
    assert len(eager) == 2  # Table 1 and 3 rows 'FSDP'; the other 8B bf16 rows compiled
    seventy = sorted((r for r in by_note.values() if "70B" in r.name), key=lambda r: r.published_step_s)
    assert [r.setup[2].overlap_tensor_parallel for r in seventy] == [True, False]  # AsyncTP is the faster
    pipelined = [r for r in rows if r.setup[1].pipeline_parallel > 1]
    assert sorted((r.setup[1].micro_batches, r.setup[1].pipeline_virtual_stages) for r in pipelined) == [
        (8, 1),
        (8, 2),
    ]


def test_search_quotes_the_error_of_the_nearest_kind_of_row(tmp_path, monkeypatch) -> None:
    """``plan --search`` says how sure it is: the fold errors averaged by chip and precision, else chip, else all."""
    from lightning_parallel.planner import validation

    rows = [*ROWS, _row("mbridge-a", 4.0, precision="fp8")]
    folds = leave_one_source_out(rows, _stub)
    kinds = validation.errors_by_kind(folds)
    assert kinds["all"]["rows"] == len(rows) and kinds["h100/fp8"]["rows"] == 1
    errors = [e for f in folds for e in f.out_of_sample]
    assert kinds["all"]["out_of_sample"] == round(sum(errors) / len(errors), 6)
    path = tmp_path / "errors.json"
    path.write_text(json.dumps(kinds))
    monkeypatch.setattr(validation, "ERRORS", path)
    assert "1 published rows on h100/fp8" in validation.expected_error("h100", "fp8")
    assert f"{kinds['h100/16-bit']['rows']} published rows on h100/16-bit" in validation.expected_error(
        "h100", "bf16-mixed"
    )
    assert "of every kind" in validation.expected_error("tpu-v9", "bf16-mixed")


def test_the_shipped_errors_are_those_of_the_table_in_the_docs() -> None:
    """``--write`` writes both; a table regenerated without the file (or the reverse) fails here."""
    from pathlib import Path

    from lightning_parallel.planner.validation import ERRORS

    overall = json.loads(ERRORS.read_text())["all"]
    doc = (Path(__file__).parents[2] / "docs" / "planner.md").read_text()
    assert f"| **all** | {overall['rows']} | **{100 * overall['out_of_sample']:.1f}%** |" in doc


def test_gpt_rows_keep_gpt_3s_block_whatever_fields_they_list() -> None:
    """Korthikanti et al.'s rows list kv_heads equal to heads; that must not make their GPTs gated (a third more MLP)."""
    rows = [r for r in load_rows() if r.problem is None and r.source.startswith("korthikanti")]
    assert rows and all(not r.setup[0].blocks[0].gated and r.setup[0].tied_head for r in rows)
    assert all(not r.setup[2].overlap_tensor_parallel for r in rows)  # 2022: collectives in line
    llama = [r for r in load_rows() if r.problem is None and "llama" in r.name.lower()]
    assert llama and all(r.setup[0].blocks[0].gated for r in llama)


def test_the_strategy_layouts_compile_argument_decides_eager_or_fused() -> None:
    """``HybridParallelStrategy(compile=...)``: eager by default, its Llama-style blocks pay the unfused passes."""
    llama, _, layout = _llama_and_gpt()
    h100 = CLUSTERS["h100"]
    default, compiled = (step_time(llama, replace(layout, compile=c), h100).total for c in (False, True))
    assert default > compiled
    assert compiled == step_time(llama, layout, h100, Execution(compiled=True)).total


def test_selective_recomputation_rows_rerun_what_their_projects_policy_reruns() -> None:
    """torchtitan's per-op policy keeps every second matmul output (the others rerun in backward); Megatron's and
    NeMo's keep them all; a layer-wise row whose frequency its source does not state is left out, not guessed."""
    rows = load_rows()
    selective = [r for r in rows if r.problem is None and r.setup[1].activation_checkpointing == "selective"]
    policies = {
        (r.source.startswith("torchtitan"), r.setup[1].activation_checkpointing_policy) for r in selective
    }
    assert policies == {(True, "ops_alternate_matmuls"), (False, "ops")}
    layer_wise = [r for r in rows if r.problem and "layer-wise" in r.problem]
    assert len(layer_wise) == 2 and all(r.source.startswith("torchtitan-docs") for r in layer_wise)
    some_blocks = [r for r in rows if r.problem and "recompute_num_layers" in r.problem]
    assert [r.source for r in some_blocks] == ["mbridge-perf-25.11"]
    shape, layout, execution = selective[0].setup  # the policy changes the predicted step (it reruns matmuls)
    cluster = CLUSTERS["h100"]
    alternate = step_time(
        shape, replace(layout, activation_checkpointing_policy="ops_alternate_matmuls"), cluster
    )
    kept = step_time(shape, replace(layout, activation_checkpointing_policy="ops"), cluster)
    assert alternate.recomputation > kept.recomputation


def test_a_run_its_publisher_measured_again_counts_once_at_its_latest_figure() -> None:
    """NeMo's pages re-measure a recipe each release: the latest figure stands for the run, the earlier one is left
    out naming the later source. Another layout, or a second figure in the same source, is not a re-measurement."""
    shape = ModelShape.gpt(4, 256, 4, 1000, name="tiny")
    layout = Layout(data_parallel=8, precision="bf16-mixed", micro_batch_size=1, sequence_length=128)
    setup = (shape, layout, Execution())
    other = (shape, replace(layout, micro_batch_size=2), Execution())

    def row(source: str, step: float, date: str, run: tuple = setup) -> Row:
        return Row(source, "tiny", "url", "h100", "16-bit", step, run, date=date)

    rows = [
        row("mbridge-perf-25.11", 2.0, "2025-12-04"),
        row("mbridge-perf-26.04", 1.5, "2026-05-27"),
        row("mbridge-perf-25.09", 3.0, "2025-10-10", other),
    ]
    kept = _superseded(rows)
    assert [r.problem is None for r in kept] == [False, True, True]
    assert "mbridge-perf-26.04" in kept[0].problem and kept[0].setup is None
    twice = _superseded(
        [row("mbridge-perf-26.04", 1.5, "2026-05-27"), row("mbridge-perf-26.04", 1.6, "2026-05-27")]
    )
    assert all(r.problem is None for r in twice)
    undated = _superseded([row("nemo-docs-25.02", 2.0, ""), row("nemo-docs-25.04", 1.8, "")])
    assert all(r.problem is None for r in undated)  # no date tells them apart: both stay
