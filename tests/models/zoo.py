"""A zoo of Hugging Face causal LMs, each from a tiny config, in the ten-line LightningModule a user writes.

Every family is ``AutoModelForCausalLM.from_config`` of its own ``model_type`` with the sizes below
(width 64, 4 query heads, 2 blocks, vocabulary 128): the model code is the library's, unchanged.
Families are chosen for what makes them different under tensor and pipeline parallelism
(``ZOO[name].trait``): fused projections of every split (q|k|v of equal or unequal widths, per-head
interleaved, grouped), multi-query attention, norms inside attention (per head or over the whole
width), attention biases computed at model level (ALiBi), parallel attention + MLP blocks, partial
rotary embeddings, logit soft-capping, and for expert parallelism fused experts, shared experts and
grouped routing.

``python -m tests.models.zoo`` lists them; ``tests.models.hf.HFZooModule`` is the LightningModule, and
``tests.models.families`` names each ``zoo_<model_type>``. This table imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What every tiny config shares, under the names most configs use; ``ZooFamily.sizes`` renames or adds.
COMMON: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
    bos_token_id=0, eos_token_id=0, pad_token_id=None, use_cache=False, tie_word_embeddings=False,
)  # fmt: skip
NO_DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout")


@dataclass(frozen=True)
class ZooFamily:
    model_type: str
    trait: str  # what makes it different, in a few words
    sizes: dict[str, Any] = field(default_factory=dict)  # config arguments beyond COMMON
    drop: tuple[str, ...] = ()  # COMMON arguments this config does not take
    moe: bool = False


ZOO: dict[str, ZooFamily] = {
    f.model_type: f
    for f in (
        ZooFamily("mistral", "GQA, sliding window", {"num_key_value_heads": 2, "sliding_window": 16}),
        ZooFamily("qwen2", "GQA, q/k/v biases", {"num_key_value_heads": 2}),
        ZooFamily("gemma", "GeGLU, head_dim independent of the width, scaled embedding",
                  {"num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": True}),
        ZooFamily("gemma2", "logit soft-capping, norms after attention and MLP",
                  {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16, "tie_word_embeddings": True,
                   "attn_implementation": "eager"}),
        ZooFamily("starcoder2", "GELU MLP with biases, GQA", {"num_key_value_heads": 2}),
        ZooFamily("stablelm", "partial rotary, LayerNorm", {"num_key_value_heads": 2, "partial_rotary_factor": 0.5}),
        ZooFamily("phi", "parallel attention and MLP, partial rotary", {"partial_rotary_factor": 0.5}),
        ZooFamily("phi3", "fused q|k|v of unequal widths (GQA), fused gate|up", {"num_key_value_heads": 2}),
        ZooFamily("gpt_neox", "fused q|k|v interleaved per head, parallel residual", {"rotary_pct": 0.5}),
        ZooFamily("gpt_bigcode", "multi-query attention: one k/v head in a fused c_attn",
                  {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_inner": 128, "multi_query": True,
                   "n_positions": 32, "attn_implementation": "sdpa"},
                  drop=("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")),
        ZooFamily("bloom", "ALiBi bias made at model level, fused q|k|v per head",
                  {"n_layer": 2, "n_head": 4, "attn_implementation": "eager"},
                  drop=("num_attention_heads", "num_hidden_layers", "intermediate_size")),
        ZooFamily("falcon", "fused q|k|v of grouped heads, parallel attention",
                  {"new_decoder_architecture": True, "num_kv_heads": 2}, drop=("intermediate_size",)),
        ZooFamily("olmo", "q, k and v clamped in place (clip_qkv)", {"num_key_value_heads": 2, "clip_qkv": 0.5}),
        ZooFamily("olmo2", "q/k RMSNorm over the whole projection width", {"num_key_value_heads": 2}),
        ZooFamily("cohere", "per-head q/k LayerNorm, parallel block, logit scale",
                  {"num_key_value_heads": 2, "use_qk_norm": True}),
        ZooFamily("granite", "residual, attention and logit multipliers", {"num_key_value_heads": 2}),
        ZooFamily("gptj", "parallel block, rotary on part of each head",
                  {"n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": 8, "n_positions": 32},
                  drop=("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")),
        ZooFamily("qwen2_moe", "MoE with a shared expert behind a gate",
                  {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1}, moe=True),
        ZooFamily("olmoe", "MoE, fused experts, q/k norms over the width, then clamped in place (clip_qkv)",
                  {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 0.5}, moe=True),
        ZooFamily("deepseek_v3", "MoE with grouped routing and shared experts; multi-head latent attention",
                  {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                   "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 0,
                   "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                   "v_head_dim": 16}, moe=True),
        ZooFamily("qwen3_moe", "MoE, fused experts, per-head q/k norms",
                  {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "head_dim": 16, "decoder_sparse_step": 1}, moe=True),
    )
}  # fmt: skip


def zoo_config(name: str, vocab_size: int, block_size: int, n_layer: int, **overrides: Any) -> Any:
    """The family's tiny config (no dropout anywhere: the parity runs compare exact numbers)."""
    from transformers import AutoConfig

    family = ZOO[name]
    arguments = {k: v for k, v in COMMON.items() if k not in family.drop}
    arguments.update(vocab_size=vocab_size, max_position_embeddings=block_size, **family.sizes, **overrides)
    if "num_hidden_layers" in arguments:
        arguments["num_hidden_layers"] = n_layer
    elif "n_layer" in arguments:
        arguments["n_layer"] = n_layer
    arguments.setdefault("attn_implementation", "sdpa")
    config = AutoConfig.for_model(family.model_type, **arguments)
    for attribute in NO_DROPOUT:
        if isinstance(getattr(config, attribute, None), float):
            setattr(config, attribute, 0.0)
    return config


if __name__ == "__main__":
    for name, family in ZOO.items():
        print(f"{name:14s} {'MoE ' if family.moe else ''}{family.trait}")
