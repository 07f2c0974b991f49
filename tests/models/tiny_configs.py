"""A tiny config for every decoder-only causal LM family of the installed ``transformers``, from its own defaults.

``tiny_config(model_type)`` starts from ``AutoConfig.for_model(model_type)`` (the family's defaults) and
shrinks it by the *names* of its attributes, never by the family's name: width 64, 4 query heads (2 k/v
heads where the family groups them, 1 where it has one), heads of 16, MLP 128, experts of 32 (4 experts,
top-2 or the family's top-1), vocabulary 128, positions 64, windows and chunks of 16 (shorter than the
32-token sequences, so they engage), no dropout, eager attention. Per-layer lists (``layer_types``,
``mlp_layer_types``, ...) keep one layer of every kind the family mixes: 2 layers for a uniform stack, 4
for a mixed one, chosen so each kind sits on both pipeline stages; index lists (``moe_layers``) follow.

``decoder_families()`` lists the families the sweep (``tools/hf_sweep.py``) trains and why the others of
the causal-LM mapping are left out: encoder-decoders, encoders that also run as decoders (they have a
masked-LM head), and multimodal wrappers whose text model is a family of its own. Families that need
``trust_remote_code`` are not in the mapping at all.
"""

from __future__ import annotations

import math
from typing import Any

WIDTH, HEADS, HEAD_DIM, FFN, EXPERT_FFN, SHARED_FFN = 64, 4, 16, 128, 32, 64
VOCAB, POSITIONS, WINDOW = 128, 64, 16

# Attribute name -> its tiny value; a callable gets the family's default value.
_SIZES: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embedding_dim", "hidden_dim", "lru_width"), WIDTH),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads",
                     "attention_heads", "num_q_heads", "swa_num_attention_heads"), HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "dim_head", "attention_head_dim", "d_head", "swa_head_dim",
                     "v_head_dim", "qk_head_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_head_dim", "index_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim"),
                    HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "dim_ff", "decoder_ffn_dim",
                     "intermediate_size_mlp", "first_dense_intermediate_size", "dense_intermediate_size",
                     "mlp_only_intermediate_size", "dff", "attention_hidden_size"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size", "expert_intermediate_size"), EXPERT_FFN),
    **dict.fromkeys(("shared_expert_intermediate_size", "shared_intermediate_size",
                     "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size"), SHARED_FFN),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
                    lambda v: 4 if v > 1 else v),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "moe_top_k", "top_k"),
                    lambda v: min(v, 2)),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), lambda v: min(v, 1)),
    **dict.fromkeys(("n_group", "num_expert_group"), lambda v: 2 if v > 1 else v),
    "topk_group": lambda v: 1, "zero_expert_num": lambda v: 2 if v > 0 else v,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "o_lora_rank": 16,
    "rotary_dim": 8, "laurel_rank": 8, "hidden_size_per_layer_input": 16, "ple_embed_dim": 16,
    "router_hidden_size": 16, "loop_gate_rank": 8, "adapter_rank": 8, "gated_norm_rank": 8, "hc_lowrank": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_num_heads": 4,
    "index_n_heads": 2, "index_num_heads": 2, "index_topk": 8, "index_block_size": 4, "index_topk_blocks": 2,
    "index_local_blocks": 1,
    "mamba_d_state": 16, "state_size": 16, "ssm_state_size": 16, "mamba_dt_rank": 8, "time_step_rank": 8,
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 8),
    **dict.fromkeys(("mamba_n_groups", "n_groups", "mamba_ngroups"), 1),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size", "block_size"), WINDOW),
    "mamba_d_ssm": FFN, "mamba_expand": 2, "expand": 2,
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "context_length",
                     "model_max_length"), POSITIONS),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "local_attention",
                     "window_size", "attention_chunk_size", "local_attention_window_len"),
                    lambda v: WINDOW if v and v > 1 else v),
    **dict.fromkeys(("bos_token_id", "eos_token_id", "eod_token_id", "decoder_start_token_id", "sep_token_id",
                     "cls_token_id"), lambda v: 0 if isinstance(v, (int, list)) else v),
    "pad_token_id": lambda v: 1 if isinstance(v, int) else v,
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "num_dense_blocks"),
                    lambda v: min(v, 1)),
    **dict.fromkeys(("attn_layer_period", "expert_layer_period", "global_attn_every_n_layers",
                     "global_attention_every_n_layers", "sliding_window_pattern", "_sliding_window_pattern",
                     "interleave_moe_layer_step", "no_rope_layer_interval", "moe_layer_interval",
                     "decoder_sparse_step"), lambda v: min(v, 2)),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset"), lambda v: min(v, 1)),
    "num_kv_shared_layers": lambda v: min(v, 2), "use_mamba_kernels": False, "router_jitter_noise": 0.0,
    "moe_jitter_eps": None, "use_cache": False,
    # transformers' native (CPU) chunkwise mLSTM kernel writes keys' states into values-wide slots: it runs
    # only with keys as wide as values (xLSTM's default halves them for its GPU kernels)
    "qk_dim_factor": 1.0,
}  # fmt: skip
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "kv_n_heads", "num_query_groups",
             "multi_query_group_num", "swa_num_key_value_heads")  # fmt: skip
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_blocks")
_PER_LAYER_INDEX_LISTS = ("moe_layers", "full_attn_idxs", "mlp_only_layers", "hybrid_layer_ids", "index_layers",
                          "ple_layer_ids")  # fmt: skip
_DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate", "attn_drop")


def _default_layers(defaults: dict[str, Any]) -> int | None:
    return next((defaults[k] for k in _LAYERS if isinstance(defaults.get(k), int)), None)


def layer_picks(defaults: dict[str, Any]) -> list[int] | None:
    """The default layers the tiny model keeps (indices into the family's per-layer lists), in order.

    One layer of every distinct kind (the tuple of its entries in every per-layer list of strings), then
    the kinds again, alternating, so that a stack of four cut in two holds each kind on both halves.
    """
    total = _default_layers(defaults)
    if not total:
        return None
    lists = [
        v
        for v in defaults.values()
        if isinstance(v, list) and len(v) == total and v and isinstance(v[0], str)
    ]
    kinds = [tuple(lst[i] for lst in lists) for i in range(total)]
    distinct = list(dict.fromkeys(kinds))
    if len(distinct) <= 1:
        return list(range(min(2, total)))
    wanted = [distinct[i % len(distinct)] for i in range(max(4, min(len(distinct), 4)))][:4]
    picks: list[int] = []
    start = 0
    for kind in wanted:
        later = [i for i in range(start, total) if kinds[i] == kind]
        unused = [i for i in range(total) if kinds[i] == kind and i not in picks]
        if later or unused:
            picks.append((later or unused)[0])
            start = picks[-1] + 1
    picks = sorted(set(picks))
    return picks


def _kv_heads(default: Any, heads: Any) -> Any:
    if not isinstance(default, int) or isinstance(default, bool):
        return default
    if isinstance(heads, int) and default >= heads:
        return HEADS
    return 1 if default == 1 else 2


def shrink(defaults: dict[str, Any], picks: list[int] | None) -> dict[str, Any]:
    """The tiny values of the attributes of ``defaults`` (one config level) that must change."""
    total = _default_layers(defaults)
    heads = next(
        (defaults[k] for k in ("num_attention_heads", "n_head", "num_heads", "n_heads") if k in defaults),
        None,
    )
    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if key in ("id2label", "label2id", "architectures", "transformers_version", "_name_or_path"):
            continue
        if isinstance(value, dict) and "model_type" in value:  # a nested config (DBRX's attn_config, MPT's)
            nested = shrink(value, picks)
            out[key] = {k: v for k, v in {**value, **nested}.items() if k not in ("id2label", "label2id")}
        elif key in _KV_HEADS:
            out[key] = _kv_heads(value, heads)
        elif key in _LAYERS and isinstance(value, int) and picks is not None:
            out[key] = len(picks)
        elif isinstance(value, float) and any(word in key for word in _DROPOUT_WORDS):
            out[key] = 0.0
        elif isinstance(value, list) and picks is not None and total and len(value) == total:
            if key == "kv_source_layers":
                out[key] = [picks.index(value[i]) if value[i] in picks else n for n, i in enumerate(picks)]
            else:
                out[key] = [_tiny(key, value[i]) for i in picks]
        elif isinstance(value, list) and picks is not None and key in _PER_LAYER_INDEX_LISTS:
            out[key] = [picks.index(i) for i in value if i in picks]
        elif key in _SIZES and value is not None and isinstance(value, bool) == isinstance(_SIZES[key], bool):
            out[key] = _tiny(key, value)
    return out


def _tiny(key: str, value: Any) -> Any:
    rule = _SIZES.get(key)
    if isinstance(rule, bool) and isinstance(value, bool):
        return rule  # a switch turned off (a cache, a fused kernel): training needs neither
    if rule is None or isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, list):
        return [_tiny(key, v) for v in value]
    return rule(value) if callable(rule) else rule


# Left unset (None) by a family's defaults although its code computes with them: a sparse-attention indexer's
# sizes, a clamp of q|k|v (DBRX's published models set 8).
_UNSET_READ_ANYWAY = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                      "indexer_budget": WINDOW, "indexer_compress_ratio": 4, "clip_qkv": 8.0}  # fmt: skip


def _repair(defaults: dict[str, Any], arguments: dict[str, Any]) -> None:
    """Sizes that depend on each other, and defaults left unset that the family's code reads anyway."""
    for key, value in _UNSET_READ_ANYWAY.items():
        if key in defaults and defaults[key] is None:
            arguments[key] = value
    if (
        "mlp_layer_types" in arguments and "first_k_dense_replace" in arguments
    ):  # both say which MLPs are dense
        arguments["first_k_dense_replace"] = arguments["mlp_layer_types"].count("dense")
    if defaults.get("head_dim") is not None and defaults.get("head_dim") == defaults.get("qk_rope_head_dim"):
        arguments["head_dim"] = arguments["qk_rope_head_dim"]  # latent attention: rotary on head_dim features
    elif "head_dim" in defaults and defaults["head_dim"] is None:
        arguments["head_dim"] = HEAD_DIM
    for key in _KV_HEADS:
        if key in defaults and defaults[key] is None and key != "swa_num_key_value_heads":
            arguments[key] = HEADS
    if "moe_intermediate_size" in defaults:  # experts declared but their counts left unset
        for key, value in (("n_routed_experts", 4), ("num_experts_per_tok", 2), ("n_shared_experts", 1)):
            if key in defaults and defaults[key] is None:
                arguments[key] = value
    if "num_heads" in arguments and "expand" in defaults and isinstance(defaults.get("head_dim"), int):
        arguments["num_heads"] = (
            defaults["expand"] * WIDTH // HEAD_DIM
        )  # state-space heads span the expanded width
    layers = next((arguments[k] for k in _LAYERS if k in arguments), 2)
    if "layer_types" in defaults and defaults["layer_types"] is None:
        arguments["layer_types"] = ["full_attention"] * layers
    types = arguments.get("layer_types")
    if defaults.get("rope_parameters") == {} and isinstance(types, list):  # rotary per layer type, left empty
        arguments["rope_parameters"] = {
            t: {"rope_type": "default", "rope_theta": 10000.0} for t in set(types)
        }
    if isinstance(types, list) and types and set(types) == {"linear_attention"}:
        arguments["layer_types"] = [*types[:-1], "full_attention"]  # a hybrid needs one attention layer
    if "attn_layer_indices" in defaults and defaults["attn_layer_indices"] is None:
        arguments["attn_layer_indices"] = [layers - 1]
    pattern = defaults.get("block_types")
    if isinstance(pattern, list) and 1 < len(set(pattern)) and len(pattern) <= 4:
        for key in _LAYERS:
            if key in arguments:
                arguments[key] = len(pattern)  # one block of each kind of the repeating pattern


def tiny_arguments(model_type: str) -> dict[str, Any]:
    """The keyword arguments of the family's tiny config (``AutoConfig.for_model(model_type, **them)``)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    picks = layer_picks(defaults)
    arguments = {k: v for k, v in shrink(defaults, picks).items() if not isinstance(defaults.get(k), dict)}
    _repair(defaults, arguments)
    return arguments


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The family's tiny config, eager attention, no dropout anywhere (the parity runs compare exact numbers).

    Nested configs (DBRX's ``attn_config``, ``ffn_config``) are shrunk in place once built: rebuilt from a
    dictionary they lose what their parent gave them.
    """
    from transformers import AutoConfig, PretrainedConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    arguments = {**tiny_arguments(model_type), **overrides}
    arguments.setdefault("attn_implementation", "eager")
    config = AutoConfig.for_model(model_type, **arguments)
    rope = getattr(config, "rope_parameters", None)
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig):
            for key, tiny in shrink(value.to_dict(), layer_picks(defaults)).items():
                setattr(value, key, tiny)
            if isinstance(rope, dict) and "rope_theta" in rope and not hasattr(value, "rope_theta"):
                value.rope_theta = rope["rope_theta"]  # a nested attention config its code reads it from
            for key, unset in _UNSET_READ_ANYWAY.items():
                if key in vars(value) and getattr(value, key) is None:
                    setattr(value, key, unset)
    for owner in [config, *(v for v in vars(config).values() if isinstance(v, PretrainedConfig))]:
        for key, value in list(vars(owner).items()):
            if (
                isinstance(value, float)
                and any(word in key for word in _DROPOUT_WORDS)
                and not math.isnan(value)
            ):
                setattr(owner, key, 0.0)
    return config


# ---- which families ---------------------------------------------------------------------------------


def decoder_families() -> tuple[list[str], dict[str, str]]:
    """The decoder-only model types of the causal-LM mapping, and every other one with why it is left out."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    families, left_out = [], {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if not _takes_labels(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]):
            left_out[model_type] = (
                "its causal-LM class takes no labels: a draft model for speculative decoding, run on a backbone's"
                " hidden states and keys and values, not trained on tokens alone"
            )
            continue
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 - a family whose defaults do not build stays in: its row says why
            families.append(model_type)
            continue
        subs = set(getattr(config, "sub_configs", None) or {})
        if getattr(config, "is_encoder_decoder", False):
            left_out[model_type] = "encoder-decoder"
        elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            left_out[model_type] = "an encoder (it has a masked-LM head) that can also run as a decoder"
        elif subs & {"text_config", "vision_config", "audio_config", "vq_config"}:
            left_out[model_type] = (
                "multimodal: its text decoder is a family of its own or not causal-LM alone"
            )
        else:
            families.append(model_type)
    return families, left_out


def _takes_labels(class_name: str | tuple[str, ...]) -> bool:
    import inspect

    import transformers

    name = class_name[0] if isinstance(class_name, (list, tuple)) else class_name
    model_class = getattr(transformers, name, None)
    return model_class is None or "labels" in inspect.signature(model_class.forward).parameters


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_moe(config: Any) -> bool:
    """Whether the family routes tokens to experts, by its config (not by what our detection finds): the
    sweep then also tries expert parallelism, and a family our detection misses shows as refused. A config
    that says it is not one (Doge's ``is_moe=False``, its default: a dense MLP although ``num_experts`` is
    set) is taken at its word."""
    if getattr(config, "is_moe", None) is False:
        return False
    values = [getattr(config, k, None) for k in _EXPERT_COUNTS]
    values += [
        getattr(sub, k, None)
        for sub in vars(config).values()
        if hasattr(sub, "to_dict")
        for k in _EXPERT_COUNTS
    ]
    return any(isinstance(v, int) and v > 1 for v in values)


if __name__ == "__main__":
    names, others = decoder_families()
    print(f"{len(names)} decoder-only families; left out {len(others)}:")
    for name, why in others.items():
        print(f"  {name}: {why}")
