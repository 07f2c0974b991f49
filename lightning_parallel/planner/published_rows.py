"""Published training runs as the planner's inputs: the rows ``planner/validation.py`` predicts.

Each row of ``published_runs.json`` (its source's link and the configuration the source states) becomes a
model shape, a layout and what its code did beyond its degrees (``Execution``: overlap, compiled or eager,
fp8 and its casts), read from the row, never fitted; the two tables of ``published.py`` join them with the
assumptions that module documents. A row the model cannot express (a chip without a preset, multi-head
latent attention, a field the source does not give, a throughput only as FLOP/s in a convention it does
not state) keeps the reason and no setup: it is left out, never guessed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.micro_batch import Execution
from lightning_parallel.planner.published import MEGATRON_H100, PTD_P, PublishedRun, _setup, published_flops
from lightning_parallel.planner.shapes import ModelShape

__all__ = ["ARCHITECTURES", "DATA", "SOURCE_GROUPS", "Row", "load_rows", "source_group"]

DATA = Path(__file__).with_name("published_runs.json")
# Who measured a source's rows: the unit left out.
SOURCE_GROUPS = {
    "mbridge": "NVIDIA NeMo / Megatron-Bridge",
    "nemo-docs": "NVIDIA NeMo / Megatron-Bridge",
    "megatron-lm": "Megatron-LM",
    "PTD-P": "Megatron-LM",
    "torchtitan": "torchtitan",
    "korthikanti2022": "Korthikanti et al. 2022",
    "bloom": "BigScience BLOOM",
    "megascale": "MegaScale",
    "llama3": "Llama 3 paper",
    "mtnlg": "MT-NLG",
    "opt": "OPT",
    "lent-h200": "the lent H200",
}
# Vocabularies a source leaves to the tokenizer (Meta's published model configs).
_VOCAB = (("llama 3", 128_256), ("llama3", 128_256), ("llama 2", 32_000))


def source_group(source: str) -> str:
    for prefix, group in SOURCE_GROUPS.items():
        if source.startswith(prefix):
            return group
    return source


@dataclass(frozen=True)
class Row:
    """One published run: where it comes from, what the model needs to predict it, and what was measured."""

    source: str
    name: str
    url: str
    chip: str
    precision: str
    """``"16-bit"`` or ``"fp8"``: which fitted efficiency its matmuls run at."""
    published_step_s: float
    setup: tuple[ModelShape, Layout, Execution] | None = field(default=None, compare=False, repr=False)
    problem: str | None = None
    """Why the model cannot express it (then it is left out)."""
    cluster: str | None = None
    """The preset it is predicted on, where not ``chip``'s (a variant of the chip: its efficiency is the chip's fit)."""
    date: str = ""
    """The ISO date its source was published (``""``: undated), which orders a publisher's releases."""

    @property
    def group(self) -> str:
        return source_group(self.source)

    @property
    def key(self) -> tuple[str, str]:
        return self.chip, self.precision


ARCHITECTURES = {"h100-hbm2e-500w": "h100"}
"""Presets that are variants of a chip: their rows are fitted (and their errors counted) as the chip's."""


def _preset(hardware: str | None, chip: str | None) -> str | None:
    """The cluster preset a row ran on where it is not its chip's: the 96 GB HBM2e, 500 W H100 (torchtitan's)."""
    text = (hardware or "").lower()
    return "h100-hbm2e-500w" if chip == "h100" and "hbm2e" in text else chip


def _chip(hardware: str | None) -> str | None:
    text = (hardware or "").lower()
    for token, chip in (
        ("gb200", "gb200"),
        ("b200", "b200"),
        ("h200", "h200"),
        ("h100", "h100"),
        ("a100", "a100-80gb"),
    ):
        if token in text:
            return chip
    return None


def _fp8(raw: dict[str, Any]) -> bool:
    return bool(re.search(r"fp8|float8", str(raw.get("precision")), re.IGNORECASE))


_GPT_STYLE = ("gpt", "megatron-turing", "bloom", "opt")
_FLOAT8_CAST_PASSES = {
    False: 0.5,
    True: 2.5,
}  # by "torchtitan's (torchao's) casts": Transformer Engine's else


def _compiled(raw: dict[str, Any]) -> bool:
    """Whether a row's memory-bound ops ran fused: as its source says; unsaid, Megatron's and NeMo's fused kernels
    are, torchtitan's eager default (``training.compile = false``) is not."""
    if raw.get("compile") is not None:
        return bool(raw["compile"])
    return not str(raw["source"]).startswith("torchtitan")


def _recompute(text: str | None) -> str | None:
    words = (text or "").lower()
    if words.startswith("full"):
        return "full"
    if words.startswith("selective"):
        return "selective"
    return None


def _selective_policy(raw: dict[str, Any]) -> str:
    """torchtitan's per-op selective recomputation keeps every second ``mm`` output only and reruns the others
    (its ``_save_list`` policy counts the block's matmuls: read at the benchmarked commits); Megatron's and NeMo's
    keep every matmul output and rerun the attention core or the cheap ops."""
    torchtitan = str(raw["source"]).startswith("torchtitan")
    return (
        "ops_alternate_matmuls" if torchtitan and _recompute(raw.get("recompute")) == "selective" else "ops"
    )


def _published_step(raw: dict[str, Any]) -> float | None:
    value, metric = raw.get("value"), raw.get("metric")
    tokens = (raw.get("global_batch") or 0) * (raw.get("seq_len") or 0)
    if metric == "step_time_s" and value:
        return float(value)
    if metric == "tokens_per_sec_per_gpu" and value and tokens and raw.get("gpus"):
        return tokens / (float(value) * raw["gpus"])
    step = (raw.get("other_metrics") or {}).get("step_time_s")
    return float(step) if isinstance(step, (int, float)) else None


def _express(raw: dict[str, Any]) -> tuple[tuple[ModelShape, Layout, Execution] | None, str | None]:
    """The planner's inputs for a row of ``published_runs.json``, or why it cannot have them."""
    config = raw.get("model_config") or {}
    name = str(raw.get("model") or "")
    missing = [k for k in ("gpus", "tp", "pp", "global_batch", "micro_batch", "seq_len") if not raw.get(k)]
    missing += [f"model {k}" for k in ("layers", "hidden", "heads") if not config.get(k)]
    if missing:
        return None, f"the source does not give {', '.join(missing)}"
    if "deepseek" in name.lower() or config.get("q_lora_rank") or config.get("kv_lora_rank"):
        return None, "multi-head latent attention (not in the planner's block shapes)"
    recompute = str(raw.get("recompute") or "").lower()
    if recompute.startswith("selective layer"):
        return None, "layer-wise selective recomputation (every n-th block whole, n not stated)"
    if "recompute_num_layers" in recompute:
        return (
            None,
            "whole-block recomputation of some blocks per stage only (Megatron's recompute_num_layers)",
        )
    vocab = config.get("vocab") or next((v for k, v in _VOCAB if k in name.lower()), None)
    if vocab is None:
        return None, "the source does not give the vocabulary"
    gpus, tp, pp, cp = raw["gpus"], raw["tp"], raw["pp"], raw.get("cp") or 1
    ep = raw.get("ep") or 1
    dp = gpus // (tp * pp)  # context parallelism carved out of it, as the strategy does: dp / cp batches
    replicas = dp // cp
    micro_batches = raw["global_batch"] // (replicas * raw["micro_batch"])
    if (
        dp * tp * pp != gpus
        or dp % cp
        or micro_batches < 1
        or raw["global_batch"] % (replicas * raw["micro_batch"])
    ):
        return (
            None,
            f"{gpus} GPUs, tp {tp}, pp {pp} and batch {raw['global_batch']} do not make whole replicas",
        )
    if dp % ep:
        return (
            None,
            "expert parallelism over more ranks than data parallelism (Megatron folds it over tp too)",
        )
    experts = config.get("experts") or config.get("num_experts") or 0
    ffn = config.get("ffn_hidden") or config.get("ffn_hidden_derived") or config.get("expert_ffn_hidden")
    if experts:
        ffn = config.get("expert_ffn_hidden") or ffn
    # GPT-3's design (GeLU MLP, biases, tied embeddings) whatever fields the row lists: Korthikanti et al.'s rows give
    # kv_heads equal to heads, which must not make them gated
    gpt_style = name.lower().startswith(_GPT_STYLE)
    llama_like = not gpt_style and (bool(config.get("kv_heads")) or "llama" in name.lower() or bool(experts))
    shape = ModelShape.gpt(
        config["layers"],
        config["hidden"],
        config["heads"],
        vocab,
        ffn_hidden=ffn,
        kv_heads=config.get("kv_heads"),
        gated=llama_like,
        tied_head=not llama_like,
        sequence_length=raw["seq_len"],
        num_experts=experts,
        top_k=config.get("top_k") or 0,
        bias=not llama_like,
        name=name,
    )
    fsdp = isinstance(raw.get("fsdp"), int) and raw["fsdp"] > 1
    vp = raw.get("vp") or 1
    layout = Layout(
        tensor_parallel=tp,
        sequence_parallel=tp > 1,
        pipeline_parallel=pp,
        pipeline_schedule="interleaved_1f1b" if vp > 1 else "1f1b",
        pipeline_virtual_stages=vp,
        micro_batches=micro_batches,
        data_parallel=dp,
        expert_parallel=ep,
        context_parallel=cp,
        zero_stage=0 if dp == 1 else 3 if fsdp else 1,
        activation_checkpointing=_recompute(raw.get("recompute")),
        activation_checkpointing_policy=_selective_policy(raw),
        precision="16-mixed" if "16-bit" in str(raw.get("precision")) else "bf16-mixed",
        micro_batch_size=raw["micro_batch"],
        sequence_length=raw["seq_len"],
        attention="flash",
    )
    execution = Execution(
        overlap_tensor_parallel=tp > 1 and raw.get("tp_comm_overlap", True),
        overlap_gradient_reduction=True,
        overlap_parameter_gather=True,
        overlap_pipeline_transfers=True,
        float8_linears=_fp8(raw),
        compiled=_compiled(raw),
        float8_cast_passes=_FLOAT8_CAST_PASSES[str(raw["source"]).startswith("torchtitan")],
        parameter_bytes=1 if raw.get("fsdp_float8_all_gather") else 2,
    )
    return (shape, layout, execution), None


def _from_source(raw: dict[str, Any]) -> Row:
    chip = _chip(raw.get("hardware"))
    setup, problem = _express(raw)
    step = _published_step(raw)
    if chip is None:
        problem = problem or "the source does not name the chip"
    if step is None:
        problem = problem or "only a FLOP rate or MFU, in a FLOP convention the source does not state"
    precision = (
        ("fp8 (torchao)" if str(raw["source"]).startswith("torchtitan") else "fp8") if _fp8(raw) else "16-bit"
    )
    return Row(
        str(raw["source"]),
        str(raw.get("model")),
        str(raw.get("url")),
        chip or "?",
        precision,
        step or math.nan,
        setup if problem is None else None,
        problem,
        _preset(raw.get("hardware"), chip),
        _iso_date(raw.get("source_date")),
    )


def _from_table(run: PublishedRun) -> Row:
    shape, layout, cluster, execution = _setup(run)
    step = published_flops(run) / (run.tflops * 1e12 * run.gpus)
    source = "PTD-P" if run in PTD_P else "megatron-lm-readme-h100-2024"
    return Row(
        source,
        f"GPT {run.name}",
        "lightning_parallel/planner/published.py",
        cluster.name,
        "16-bit",
        step,
        (shape, layout, execution),
    )


def load_rows(path: Path = DATA, *, latest_only: bool = True) -> list[Row]:
    """Every row, those the model cannot express included (``problem`` says why). The rows of the same tables
    as ``published.py`` (the Megatron-LM READMEs) come from there, with the assumptions it documents.
    ``latest_only``: a run its publisher measured again counts once, at its latest figure (:func:`_superseded`)."""
    raw_rows = json.loads(path.read_text())
    tables = {"megatron-lm-readme-a100-2021", "megatron-lm-readme-h100-2024"}
    rows = [_from_source(r) for r in raw_rows if r["source"] not in tables]
    if latest_only:
        rows = _superseded(rows)
    return rows + [_from_table(run) for run in (*PTD_P, *MEGATRON_H100)]


def _iso_date(text: Any) -> str:
    """The ISO date a ``source_date`` starts with, or ``""`` (undated: the oldest)."""
    found = re.match(r"\d{4}-\d{2}-\d{2}", str(text or ""))
    return found.group(0) if found else ""


def _superseded(rows: list[Row]) -> list[Row]:
    """Where a publisher measured the same run again in a later release (the same model, chip, layout and what its
    code did: NeMo's performance pages re-measure their recipes each container release), the latest figure stands
    for it and the earlier ones are left out: the model has no notion of a software release, and two figures of
    one run would be two answers to the same question, counted twice. ``Row.date`` orders the releases: an
    undated source counts as the oldest (NeMo's 25.02 docs, before the dated
    Megatron-Bridge pages); sources that cannot be told apart by date all stay."""
    runs: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    for index, row in enumerate(rows):
        if row.setup is not None:
            shape, layout, execution = row.setup
            key = (row.group, row.chip, str(row.cluster), repr(shape), repr(layout), repr(execution))
            runs.setdefault(key, []).append((row.date, index))
    out = list(rows)
    for same in runs.values():
        newest, latest = max(same)[0], rows[max(same)[1]]
        for date, index in same:
            if date < newest:  # strictly older: sources of one date (or both undated) all stay
                why = f"measured again in a later release of its publisher ({latest.source})"
                out[index] = replace(rows[index], setup=None, problem=why)
    return out
