"""The planner's memory per rank for layouts published as trained on 80 GB GPUs (issue 34's table).

    python -m benchmarks.published_memory            # the markdown table of docs/planner.md

Each layout as its source ran it, planned for this project's runtime: the model built on the meta device
(the recipe GPT for Korthikanti et al.'s GPT rows, Hugging Face's ``LlamaForCausalLM`` for the Llama 3
rows), the most loaded rank's device bytes, and whether that fits the usable share of an 80 GB device the
search allows (``planner/search.py``: ``USABLE_MEMORY`` of the ``a100-80gb`` preset, 72 GiB). ``before`` is
what the planner said before issue 34 (the issue's own figures: a 16-bit copy of every weight per
micro-batch in flight, a receive buffer per micro-batch, fp32 log-probabilities over the whole vocabulary
on every tensor-parallel rank); ``after`` is computed now.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_parallel.planner.cluster import CLUSTERS
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.memory import RankMemory, rank_memory
from lightning_parallel.planner.search import USABLE_MEMORY

GIB = 2**30


@dataclass(frozen=True)
class PublishedLayout:
    name: str
    source: str
    model: tuple[str, dict[str, int]]  # ("gpt" | "llama", its sizes)
    layout: Layout
    before: float  # GiB, the planner before issue 34 (the table)


def _gpt(layers: int, hidden: int, heads: int) -> tuple[str, dict[str, int]]:
    return "gpt", {
        "n_layer": layers,
        "n_embd": hidden,
        "n_head": heads,
        "vocab_size": 51200,
        "block_size": 2048,
    }


def _llama(layers: int, hidden: int, heads: int, ffn: int) -> tuple[str, dict[str, int]]:
    return "llama", {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                     "num_key_value_heads": 8, "intermediate_size": ffn, "vocab_size": 128256}  # fmt: skip


_KORTHIKANTI = "Korthikanti et al. 2022, Table 5"
_GPT_TP_PP = {"tensor_parallel": 8, "sequence_parallel": True, "activation_checkpointing": "selective",
              "precision": "16-mixed", "sequence_length": 2048}  # fmt: skip
LAYOUTS = (
    PublishedLayout("GPT 175B, TP 8 + SP, PP 8 (1F1B, 64 micro-batches of 1), selective, fp16", _KORTHIKANTI,
                    _gpt(96, 12288, 96), Layout(pipeline_parallel=8, micro_batches=64, **_GPT_TP_PP), 97.9),
    PublishedLayout("GPT 530B, TP 8 + SP, PP 35, selective", _KORTHIKANTI, _gpt(105, 20480, 128),
                    Layout(pipeline_parallel=35, micro_batches=280, **_GPT_TP_PP), 183.6),
    PublishedLayout("GPT 1T, TP 8 + SP, PP 64, selective", _KORTHIKANTI, _gpt(128, 25600, 160),
                    Layout(pipeline_parallel=64, micro_batches=512, **_GPT_TP_PP), 314.4),
    PublishedLayout("Llama 3 8B, FSDP over 8 GPUs, local batch 2 x 8192, selective", "torchtitan",
                    _llama(32, 4096, 32, 14336),
                    Layout(zero_stage=3, data_parallel=8, micro_batch_size=2, sequence_length=8192,
                           activation_checkpointing="selective", precision="bf16-mixed"), 99.0),
    PublishedLayout("Llama 3 70B, FSDP 32 x TP 8, local batch 16 x 8192, full recomputation", "torchtitan",
                    _llama(80, 8192, 64, 28672),
                    Layout(tensor_parallel=8, sequence_parallel=True, zero_stage=3, data_parallel=32,
                           micro_batch_size=16, sequence_length=8192, activation_checkpointing="full",
                           precision="bf16-mixed"), 126.8),
    PublishedLayout("Llama 3 70B, TP 4 + SP, PP 8 interleaved (5 virtual stages), micro-batch 1 x 8192,"
                    " distributed optimizer", "Megatron-Bridge", _llama(80, 8192, 64, 28672),
                    Layout(tensor_parallel=4, sequence_parallel=True, pipeline_parallel=8,
                           pipeline_schedule="interleaved_1f1b", pipeline_virtual_stages=5, micro_batches=64,
                           data_parallel=2, zero_stage=1, micro_batch_size=1, sequence_length=8192,
                           precision="bf16-mixed"), 227.5),
)  # fmt: skip


def build(model: tuple[str, dict[str, int]]) -> torch.nn.Module:
    kind, sizes = model
    with torch.device("meta"):
        if kind == "gpt":
            from recipes.gpt.module import GPTLightningModule

            return GPTLightningModule(**sizes)
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**sizes, max_position_embeddings=8192, use_cache=False, attn_implementation="sdpa",
                             tie_word_embeddings=False)  # fmt: skip
        return LlamaForCausalLM(config)


def most_loaded(row: PublishedLayout) -> RankMemory:
    return max(rank_memory(build(row.model), row.layout), key=lambda r: r.device_total)


def usable_bytes(cluster: str = "a100-80gb") -> float:
    return USABLE_MEMORY * CLUSTERS[cluster].memory_bytes


def alternate(row: PublishedLayout) -> PublishedLayout | None:
    """The row with selective recomputation as ``activation_checkpointing_policy="ops_alternate_matmuls"``
    (torchtitan's own selective policy: every second matmul rerun) where it does not recompute whole blocks:
    for Korthikanti et al.'s rows the memory their recomputation of the attention core bought, paid for here
    with other matmuls; for the row that recomputes nothing (Megatron-Bridge's, which ran fp8 with a 16-bit
    residual stream), the memory this runtime's bf16 autocast needs on top (docs/planner.md)."""
    if row.layout.activation_checkpointing == "full":
        return None
    layout = replace(
        row.layout,
        activation_checkpointing="selective",
        activation_checkpointing_policy="ops_alternate_matmuls",
    )
    return replace(row, layout=layout)


def rows() -> list[dict[str, Any]]:
    out = []
    for row in LAYOUTS:
        rank = most_loaded(row)
        other = alternate(row)
        alt = most_loaded(other).device_total if other is not None else None
        best = min(rank.device_total, alt) if alt is not None else rank.device_total
        out.append({"name": row.name, "source": row.source, "before": row.before, "after": rank.device_total / GIB,
                    "alternate": alt / GIB if alt is not None else None, "fits": best <= usable_bytes(),
                    "rank": rank})  # fmt: skip
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| published layout (80 GB GPUs) | source | before (GiB) | after (GiB) | parameters + gradients +"
             " optimizer / activations / buffers after | after, selective as `ops_alternate_matmuls` (GiB) |"
             " fits in 72 GiB |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in table:
        rank = r["rank"]
        parts = f"{rank.states / GIB:.1f} / {rank.activations / GIB:.1f} / {rank.buffers / GIB:.2f}"
        alt = f"{r['alternate']:.1f}" if r["alternate"] is not None else "—"
        lines.append(f"| {r['name']} | {r['source']} | {r['before']:.1f} | {r['after']:.1f} | {parts} | {alt} |"
                     f" {'yes' if r['fits'] else 'no'} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(rows()))
