"""``auto_plan`` and ``plan_from_dict`` on unchanged models, without a process group.

Four families, as a user would bring them: the recipe GPT, a nanoGPT-style model, and Hugging
Face GPT-2 (``Conv1D``, fused ``c_attn``) and Llama (separate q/k/v, gate/up/down, GQA) built
from tiny configs (no download). For each: which module gets which style, which attributes
are rewritten for the local shard, norms only under sequence parallelism, and the errors for
layouts that cannot be split evenly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_parallel.plans import ParallelPlan, auto_plan, plan_from_dict
from lightning_parallel.plans.user import STYLE_NAMES
from lightning_parallel.tensor_parallel import ColwiseProjection, RowwiseProjection
from lightning_parallel.tensor_parallel.styles import TokenEmbedding, is_conv1d, projection_dims

# ---- the models ------------------------------------------------------------------------------


def recipe_gpt(**overrides: int) -> nn.Module:
    from recipes.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            **{"vocab_size": 320, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64, **overrides}
        )
    )


def nanogpt(**overrides: int) -> nn.Module:
    from tests.models.nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            **{"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64, **overrides}
        )
    )


def hf_gpt2(**overrides: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        **{"vocab_size": 128, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 4,
           "bos_token_id": 0, "eos_token_id": 0, **overrides}
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def hf_llama(**overrides: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        **{"vocab_size": 128, "max_position_embeddings": 32, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None, **overrides}
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class GQAAttention(nn.Module):
    """Grouped-query attention that stores its key/value head count (as many codebases do)."""

    def __init__(self, dim: int = 64, n_head: int = 4, n_kv_head: int = 2) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, n_kv_head * self.head_dim)
        self.wv = nn.Linear(dim, n_kv_head * self.head_dim)
        self.wo = nn.Linear(dim, dim)


class GQAModel(nn.Module):
    def __init__(self, n_kv_head: int = 2, n_head: int = 4, dim: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([GQAAttention(dim, n_head, n_kv_head) for _ in range(2)])


# ---- helpers ---------------------------------------------------------------------------------


def _styles_by_suffix(plan: ParallelPlan, block: str) -> dict[str, object]:
    prefix = block + "."
    return {name[len(prefix) :]: style for name, style in plan.styles.items() if name.startswith(prefix)}


def _assert_colwise(style: object, num_chunks: int = 1) -> None:
    assert isinstance(style, ColwiseProjection), style
    assert style.num_chunks == num_chunks
    assert style.output_layouts[0] == Shard(-1)


def _assert_rowwise(style: object, sequence_parallel: bool) -> None:
    assert isinstance(style, RowwiseProjection), style
    assert style.input_layouts[0] == Shard(-1)
    assert style.output_layouts[0] == (Shard(1) if sequence_parallel else Replicate())


def _assert_embedding_and_head(plan: ParallelPlan, embedding: str, head: str) -> None:
    emb = plan.styles[embedding]
    assert (
        type(emb) is TokenEmbedding
    )  # vocabulary-parallel embedding, output replicated (a tensor of its own)
    assert emb.input_layouts[0] == Replicate() and emb.output_layouts[0] == Replicate()
    out = plan.styles[head]
    assert isinstance(out, ColwiseProjection) and out.output_layouts[0] == Replicate()  # logits gathered


def _container(plan: ParallelPlan, name: str):
    container = plan.container(name)
    assert container is not None, f"no container {name}; have {[c.name for c in plan.containers]}"
    return container


# ---- the recipe GPT and nanoGPT: fused q|k|v as nn.Linear -------------------------------------

GPT_LIKE = [
    pytest.param(recipe_gpt, "qkv", "proj", "fc", "proj", id="recipe_gpt"),
    pytest.param(nanogpt, "c_attn", "c_proj", "c_fc", "c_proj", id="nanogpt"),
]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize(("build", "qkv", "attn_out", "fc", "mlp_out"), GPT_LIKE)
def test_gpt_like(build, qkv: str, attn_out: str, fc: str, mlp_out: str, sequence_parallel: bool) -> None:
    plan = auto_plan(build(), 2, sequence_parallel=sequence_parallel)
    assert plan.block_list == "transformer.h"
    assert plan.block_names == ["transformer.h.0", "transformer.h.1"]
    for block in plan.block_names:
        styles = _styles_by_suffix(plan, block)
        _assert_colwise(styles[f"attn.{qkv}"], num_chunks=3)  # each rank gets its slice of q, k and v
        _assert_rowwise(styles[f"attn.{attn_out}"], sequence_parallel)
        _assert_colwise(styles[f"mlp.{fc}"])
        _assert_rowwise(styles[f"mlp.{mlp_out}"], sequence_parallel)
        norms = {name for name, style in styles.items() if isinstance(style, SequenceParallel)}
        assert norms == ({"ln_1", "ln_2"} if sequence_parallel else set())
        attention = _container(plan, f"{block}.attn")
        assert attention.kind == "attention"
        assert attention.entries == [f"{block}.attn.{qkv}"] and attention.exit == f"{block}.attn.{attn_out}"
        assert attention.scaled_attributes == {"n_head": (4, 2), "n_embd": (64, 32)}  # head_dim stays 16
        mlp = _container(plan, f"{block}.mlp")
        assert mlp.kind == "mlp" and mlp.hidden_size == 64
    _assert_embedding_and_head(plan, "transformer.wte", "lm_head")
    assert "transformer.wpe" not in plan.styles  # position embeddings stay replicated
    assert "transformer.ln_f" not in plan.styles  # the final norm is outside the blocks
    assert plan.norms == (
        [f"transformer.h.{i}.ln_{j}" for i in (0, 1) for j in (1, 2)] if sequence_parallel else []
    )


def test_scaling_follows_the_degree() -> None:
    plan = auto_plan(recipe_gpt(n_head=8, n_embd=128), 4, sequence_parallel=False)
    assert _container(plan, "transformer.h.0.attn").scaled_attributes == {
        "n_head": (8, 2),
        "n_embd": (128, 32),
    }


def test_vocabulary_not_divisible_leaves_embedding_and_head_replicated() -> None:
    plan = auto_plan(recipe_gpt(vocab_size=321), 2, sequence_parallel=False)
    assert "transformer.wte" not in plan.styles and "lm_head" not in plan.styles
    assert any("vocabulary 321 not divisible by 2" in note for note in plan.notes)
    assert "vocabulary 321 not divisible by 2" in str(plan)


# ---- Hugging Face GPT-2: Conv1D (weights stored transposed), fused c_attn ---------------------


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_hf_gpt2(sequence_parallel: bool) -> None:
    model = hf_gpt2()
    c_attn = model.transformer.h[0].attn.c_attn
    assert is_conv1d(c_attn) and tuple(c_attn.weight.shape) == (64, 192)  # (in, out): transposed
    assert projection_dims(c_attn) == (64, 192)
    plan = auto_plan(model, 2, sequence_parallel=sequence_parallel)
    assert plan.block_list == "transformer.h"
    for block in plan.block_names:
        styles = _styles_by_suffix(plan, block)
        _assert_colwise(styles["attn.c_attn"], num_chunks=3)
        _assert_rowwise(styles["attn.c_proj"], sequence_parallel)
        _assert_colwise(styles["mlp.c_fc"])
        _assert_rowwise(styles["mlp.c_proj"], sequence_parallel)
        norms = {name for name, style in styles.items() if isinstance(style, SequenceParallel)}
        assert norms == ({"ln_1", "ln_2"} if sequence_parallel else set())
        assert _container(plan, f"{block}.attn").scaled_attributes == {
            "embed_dim": (64, 32),
            "num_heads": (4, 2),
            "split_size": (64, 32),
        }
    _assert_embedding_and_head(plan, "transformer.wte", "lm_head")


# ---- Hugging Face Llama: separate q/k/v/o and gate/up/down, RMSNorm, GQA ----------------------


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_hf_llama(sequence_parallel: bool) -> None:
    plan = auto_plan(hf_llama(), 2, sequence_parallel=sequence_parallel)
    assert plan.block_list == "model.layers"
    for block in plan.block_names:
        styles = _styles_by_suffix(plan, block)
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            _assert_colwise(styles[name])  # separate projections: no chunking
        _assert_rowwise(styles["self_attn.o_proj"], sequence_parallel)
        _assert_rowwise(styles["mlp.down_proj"], sequence_parallel)
        norms = {name for name, style in styles.items() if isinstance(style, SequenceParallel)}
        assert norms == ({"input_layernorm", "post_attention_layernorm"} if sequence_parallel else set())
        attention = _container(plan, f"{block}.self_attn")
        assert attention.kind == "attention" and len(attention.entries) == 3
        # transformers 5 attention reads `-1` heads and a fixed head_dim: nothing to rewrite.
        assert attention.scaled_attributes == {}
        assert _container(plan, f"{block}.mlp").entries == [f"{block}.mlp.gate_proj", f"{block}.mlp.up_proj"]
    _assert_embedding_and_head(plan, "model.embed_tokens", "lm_head")
    assert "model.norm" not in plan.styles


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_per_head_query_and_key_norms_sum_their_weight_gradient_over_the_ranks(
    sequence_parallel: bool,
) -> None:
    """Qwen3's q_norm/k_norm (over head_dim) get torch's SequenceParallel over the heads' dimension: the weight
    becomes a replicated DTensor and its gradient is summed over the ranks (without it, the verification
    refused every Qwen3 layer: each rank's gradient held only its own heads'). Llama has none."""
    from tests.models.families import build

    plan = auto_plan(build("hf_qwen3"), 2, sequence_parallel=sequence_parallel)
    for block in plan.block_names:
        styles = _styles_by_suffix(plan, block)
        for name in ("self_attn.q_norm", "self_attn.k_norm"):
            assert isinstance(styles[name], SequenceParallel) and styles[name].sequence_sharding == (
                Shard(-2),
            )
    llama = auto_plan(hf_llama(), 2, sequence_parallel=sequence_parallel)
    assert not any(
        ".self_attn." in name and isinstance(s, SequenceParallel) for name, s in llama.styles.items()
    )


# ---- layouts that cannot be split evenly ------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "tp", "fragments"),
    [
        pytest.param(
            recipe_gpt, 3, ["`tensor_parallel=3`", "4 attention heads", "`transformer.h.0.attn`", "[1, 2, 4]"],
            id="recipe_gpt-heads",
        ),
        pytest.param(
            lambda: nanogpt(n_head=6, n_embd=96), 4,
            ["`tensor_parallel=4`", "6 attention heads", "`transformer.h.0.attn`", "[1, 2, 3, 6]"],
            id="nanogpt-heads",
        ),
        pytest.param(hf_gpt2, 3, ["4 attention heads", "`transformer.h.0.attn`"], id="hf_gpt2-heads"),
        pytest.param(hf_llama, 3, ["4 attention heads", "`model.layers.0.self_attn`"], id="hf_llama-heads"),
        pytest.param(  # 3 k/v heads over 2 ranks: neither divides the other
            lambda: GQAModel(n_kv_head=3, n_head=12, dim=48), 2,
            ["`tensor_parallel=2`", "3 key/value heads", "`layers.0`", "[1, 3]"], id="gqa-kv-heads",
        ),
        pytest.param(
            lambda: hf_llama(intermediate_size=99), 2,
            ["`tensor_parallel=2`", "99 hidden units", "`model.layers.0.mlp`", "[1, 3, 9, 11, 33, 99]"],
            id="hf_llama-mlp-width",
        ),
    ],
)  # fmt: skip
def test_degree_that_does_not_divide_is_a_value_error(build, tp: int, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        auto_plan(build(), tp, sequence_parallel=False)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


def test_hf_llama_kv_heads_fewer_than_ranks_are_stored_on_several() -> None:
    """2 k/v heads over 4 ranks: each rank stores the k/v head its query head uses (each on two ranks)."""
    plan = auto_plan(hf_llama(num_key_value_heads=2), 4, sequence_parallel=False)
    styles = _styles_by_suffix(plan, "model.layers.0")
    for name in ("self_attn.k_proj", "self_attn.v_proj"):
        layout = styles[name].row_layout
        assert layout is not None and layout.duplicated and layout.ranks == 4
    assert styles["self_attn.q_proj"].row_layout is None
    attention = _container(plan, "model.layers.0.self_attn")
    assert attention.scaled_attributes == {"num_key_value_groups": (2, 1)}


def test_model_without_block_list() -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    with pytest.raises(ValueError, match=r"Sequential has no repeated block list .* Pass `plan=`"):
        auto_plan(model, 2, sequence_parallel=False)


# ---- plan=dict --------------------------------------------------------------------------------


def test_plan_from_dict_with_style_names() -> None:
    patterns = {
        "transformer.h.*.attn.c_attn": "fused_qkv",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.h.*.ln_[12]": "sequence_parallel",
        "transformer.wte": "embedding",
        "lm_head": "head",
    }
    plan = plan_from_dict(nanogpt(), patterns, 2, sequence_parallel=True)
    _assert_colwise(plan.styles["transformer.h.1.attn.c_attn"], num_chunks=3)
    _assert_rowwise(plan.styles["transformer.h.1.attn.c_proj"], sequence_parallel=True)
    assert isinstance(plan.styles["transformer.h.0.ln_2"], SequenceParallel)
    _assert_embedding_and_head(plan, "transformer.wte", "lm_head")
    assert len(plan.styles) == 2 * 6 + 2
    assert plan.block_names == ["transformer.h.0", "transformer.h.1"]
    # The containers are inferred from the colwise/rowwise pairs, with the same attribute rewriting.
    assert _container(plan, "transformer.h.0.attn").scaled_attributes == {
        "n_head": (4, 2),
        "n_embd": (64, 32),
    }
    assert _container(plan, "transformer.h.0.mlp").kind == "mlp"


def test_plan_from_dict_replicate_removes_an_earlier_match() -> None:
    patterns = {"transformer.h.*.mlp.c_*": "colwise", "transformer.h.*.mlp.c_proj": "replicate"}
    plan = plan_from_dict(nanogpt(), patterns, 2, sequence_parallel=False)
    assert sorted(plan.styles) == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]


def test_plan_from_dict_pattern_matching_nothing_names_the_pattern() -> None:
    with pytest.raises(ValueError) as info:
        plan_from_dict(nanogpt(), {"transformer.h.*.attn.c_atn": "fused_qkv"}, 2, sequence_parallel=False)
    message = str(info.value)
    assert "'transformer.h.*.attn.c_atn'" in message and "matches no module of GPT" in message


def test_plan_from_dict_missing_module_suggests_close_names() -> None:
    with pytest.raises(ValueError, match=r"'lm_haed' matches no module .* Did you mean \['lm_head'\]"):
        plan_from_dict(nanogpt(), {"lm_haed": "head"}, 2, sequence_parallel=False)


def test_plan_from_dict_unknown_style_lists_the_names() -> None:
    with pytest.raises(ValueError) as info:
        plan_from_dict(nanogpt(), {"lm_head": "column"}, 2, sequence_parallel=False)
    assert "'column'" in str(info.value)
    for name in STYLE_NAMES:
        assert name in str(info.value)


def test_plan_from_dict_heads_not_divisible() -> None:
    patterns = {"transformer.h.*.attn.c_attn": "fused_qkv", "transformer.h.*.attn.c_proj": "rowwise"}
    with pytest.raises(
        ValueError, match=r"`tensor_parallel=3` does not divide the 4 heads of `transformer.h.0.attn`"
    ):
        plan_from_dict(nanogpt(), patterns, 3, sequence_parallel=False)


# ---- the printed plan -------------------------------------------------------------------------


@pytest.mark.parametrize("build", [recipe_gpt, nanogpt, hf_gpt2, hf_llama], ids=lambda b: b.__name__)
def test_printing_the_plan(build) -> None:
    plan = auto_plan(build(), 2, sequence_parallel=True)
    text = str(plan)
    assert text.startswith("ParallelPlan(tensor_parallel=2, sequence_parallel=True)")
    assert f"block stack: {plan.block_list} (2 blocks)" in text
    for name, style in plan.styles.items():
        assert name in text and repr(style) in text
    for container in plan.containers:
        for key, (global_value, local_value) in container.scaled_attributes.items():
            assert f"{key} {global_value}->{local_value}" in text
    assert "parameters per rank" not in text  # sizes are known only once recorded


def test_printing_the_plan_with_parameter_sizes() -> None:
    plan = auto_plan(recipe_gpt(), 2, sequence_parallel=False)
    plan.parameter_shards = {"a": (100, 50, 4), "b": (28, 28, 4)}
    assert "parameters per rank: 312 B of 512 B unsharded (60.9%)" in str(plan)


# ---- Mixture-of-Experts blocks under sequence parallelism --------------------------------------


def _qwen2_moe(**overrides: object) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_configs import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("qwen2_moe", **overrides))


def test_moe_blocks_route_each_rank_s_sequence_slice_with_summed_gradients() -> None:
    from lightning_parallel.tensor_parallel.param_styles import LocalParameters

    plan = auto_plan(_qwen2_moe(), 2, sequence_parallel=True)
    mlp = "model.layers.0.mlp"
    # router and experts whole on every tp rank, their gradients summed over tp (Partial); one style on the
    # MoE block, whose code may read its children's weights (DBRX's experts read ``self.mlp.w1``)
    style = plan.styles[mlp]
    assert isinstance(style, LocalParameters) and set(style.dims.values()) == {None}
    assert {name.split(".")[0] for name in style.dims} == {"gate", "experts", "shared_expert_gate"}
    # the shared expert is an MLP like any other: column then row parallel
    assert isinstance(plan.styles[f"{mlp}.shared_expert.gate_proj"], ColwiseProjection)
    assert isinstance(plan.styles[f"{mlp}.shared_expert.down_proj"], RowwiseProjection)
    # negative control: without sequence parallelism the experts see the whole sequence and stay plain
    assert mlp not in auto_plan(_qwen2_moe(), 2, sequence_parallel=False).styles


def test_a_model_adding_its_own_router_loss_is_refused_under_sequence_parallelism() -> None:
    with pytest.raises(ValueError, match=r"output_router_logits=True.*moe_aux_loss_coef="):
        auto_plan(_qwen2_moe(output_router_logits=True), 2, sequence_parallel=True)
    auto_plan(
        _qwen2_moe(output_router_logits=True), 2, sequence_parallel=False
    )  # whole sequence on every rank: its loss is right


def test_this_library_s_moe_layer_is_refused_under_sequence_parallelism() -> None:
    from recipes.moe.model import MoEGPT, MoEGPTConfig

    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64, num_experts=4))
    with pytest.raises(
        ValueError, match=r"this library's MoE counts expert capacity.*sequence_parallel=False"
    ):
        auto_plan(model, 2, sequence_parallel=True)
    auto_plan(model, 2, sequence_parallel=False)


def test_a_hybrid_stack_of_several_layer_classes_is_the_block_list() -> None:
    from lightning_parallel.plans.detect import block_names

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 16)

    class Mixer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(16, 16, 3)

    class Hybrid(nn.Module):  # Jamba's and Zamba's layers: attention and state-space layers in one list
        def __init__(self, small_stack: bool = False) -> None:
            super().__init__()
            self.embed = nn.Embedding(1000 if small_stack else 10, 16)
            self.layers = nn.ModuleList([Mixer(), Attention(), Mixer(), Attention()])
            self.heads = nn.ModuleList([nn.Linear(16, 2), nn.Linear(16, 2)])  # same class, but small

    assert block_names(Hybrid()) == [f"layers.{i}" for i in range(4)]
    # negative control: a mixed list holding little of the model is not taken for its stack
    assert block_names(Hybrid(small_stack=True)) == ["heads.0", "heads.1"]


def test_frozen_routing_statistics_stay_plain_under_sequence_parallelism() -> None:
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_configs import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("ernie4_5_moe"))
    statistics = model.model.layers[1].mlp.gate.moe_statics
    assert (
        not statistics.e_score_correction_bias.requires_grad
    )  # updated by the model, never by the optimizer
    plan = auto_plan(model, 2, sequence_parallel=True)
    dims = plan.styles["model.layers.1.mlp"].dims  # no gradient to sum: the statistics left a plain tensor
    assert "gate.weight" in dims and not any("moe_statics" in name for name in dims)


def test_blocks_without_projections_tensor_parallelism_can_find_are_refused_not_copied() -> None:
    """JetMoE's layers (attention and MLP as mixtures of experts over stacked weights, no linear projections): a
    plan would shard only the embedding and the head, every block copied on each rank; refused at setup, naming
    the block. Negative control: the same model with one linear MLP per block gets a plan."""

    class Mixture(nn.Module):
        def __init__(self, linear: bool) -> None:
            super().__init__()
            self.experts = nn.Parameter(torch.randn(4, 16, 16))
            self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) if linear else None

    class Model(nn.Module):
        def __init__(self, linear: bool) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.layers = nn.ModuleList(Mixture(linear) for _ in range(4))
            self.head = nn.Linear(16, 64, bias=False)

    with pytest.raises(ValueError, match=r"no block of Model has an attention or MLP that tensor parallelism can"
                                         r" split: `layers\.0` \(no attention or MLP projections found\)"):  # fmt: skip
        auto_plan(Model(linear=False), 2, sequence_parallel=False)
    assert len(auto_plan(Model(linear=True), 2, sequence_parallel=False).containers) == 4
    # the message names the model whose blocks they are, not what wraps it (a LightningModule, a causal-LM head)
    wrapper = nn.Module()
    wrapper.inner = Model(linear=False)
    with pytest.raises(ValueError, match=r"no block of Model has .* `inner\.layers\.0`"):
        auto_plan(wrapper, 2, sequence_parallel=False)


@pytest.mark.parametrize(
    ("family", "refusal"),
    [
        # a block made of a state-space mixer only (Nemotron-H's Mamba layers)
        (
            "nemotron_h",
            r"cannot split `model\.layers\.0\.mixer` \(NemotronHMamba2Mixer: .*nothing else of block",
        ),
        # linear-attention mixers holding more of the blocks' matrix weights than what the plan splits
        ("qwen4_exp_text", r"cannot split `model\.layers\.0\.linear_attn` .* left whole number \d+ elements"),
        # a second stack of blocks the plan would leave whole (HRM's high- and low-level modules)
        ("hrm_text", r"cannot split `model\.H_module\.layers` \(a second stack of blocks beside"),
        # projections the plan never took for candidates holding most of the blocks (Inkling 2's wrapped ones)
        ("inkling2_text", r"cannot split `model\.layers\.0` \(of its modules the plan found"),
    ],
)
def test_hybrids_tensor_parallelism_would_mostly_copy_are_refused_naming_the_module(
    family: str, refusal: str
) -> None:
    """A plan that splits a hybrid's attention and MLPs but copies most of its blocks on every rank is refused
    at setup, naming the module it cannot split. Negative control: Jamba, whose Mamba mixers are a small part
    of its blocks, gets a plan splitting its attention and MLPs, the mixers noted as left whole."""
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_configs import tiny_config

    torch.manual_seed(0)
    with pytest.raises(ValueError, match=rf"`tensor_parallel=2`: tensor parallelism {refusal}"):
        auto_plan(AutoModelForCausalLM.from_config(tiny_config(family)), 2, sequence_parallel=False)
    plan = auto_plan(AutoModelForCausalLM.from_config(tiny_config("jamba")), 2, sequence_parallel=False)
    assert plan.containers and any("mamba: left replicated (JambaMambaMixer" in note for note in plan.notes)


def test_modules_left_whole_run_on_the_whole_sequence_under_sequence_parallelism() -> None:
    """Jamba under sequence parallelism: its Mamba mixers, called by the blocks themselves, are planned to run
    on the whole sequence; a module left whole inside a split attention (DeepSeek-V3.2's indexer) reads the
    attention's gathered input and needs nothing; the blocks' per-token weights no style covers (Gemma 3n's
    per-layer input gate, Doge's residual scalars) sum their ranks' shares. Negative control: without
    sequence parallelism none of it."""
    from transformers import AutoModelForCausalLM

    from lightning_parallel.tensor_parallel.param_styles import LocalParameters
    from tests.models.tiny_configs import tiny_config

    def build(family: str, sp: bool) -> Any:
        torch.manual_seed(0)
        return auto_plan(AutoModelForCausalLM.from_config(tiny_config(family)), 2, sequence_parallel=sp)

    jamba = build("jamba", True)
    mixers = [n for n in jamba.block_names if n + ".mamba" in jamba.whole_sequence]
    assert mixers and jamba.whole_sequence == [n + ".mamba" for n in mixers]
    assert build("jamba", False).whole_sequence == []
    indexed = build("deepseek_v32", True)
    assert indexed.whole_sequence == [] and any("indexer: left replicated" in n for n in indexed.notes)

    def shares(plan: Any) -> dict[str, str]:
        return {
            k: repr(v)
            for k, v in plan.styles.items()
            if isinstance(v, LocalParameters) and "Partial" in repr(v)
        }

    gemma = build("gemma3n_text", True)
    assert shares(gemma) == {
        block: "LocalParameters(per_layer_input_gate.weight=Partial grad, per_layer_projection.weight=Partial grad)"
        for block in gemma.block_names
    }
    assert shares(build("doge", True))["model.layers.0"] == (
        "LocalParameters(input_residual=Partial grad, post_attention_residual=Partial grad)"
    )
    assert shares(build("doge", False)) == {} and shares(build("gemma3n_text", False)) == {}


def test_an_embedding_running_modules_of_its_own_stays_whole() -> None:
    """Inkling 2 normalises inside its embedding module: a vocabulary-sharded lookup would hand the norm partial
    rows, so that embedding stays whole (noted in the plan); negative control: the plain embedding is sharded."""
    from transformers import AutoModelForCausalLM

    from tests.models.tiny_configs import tiny_config

    class NormedEmbedding(nn.Embedding):
        def __init__(self, vocab: int, width: int) -> None:
            super().__init__(vocab, width)
            self.embed_norm = nn.LayerNorm(width)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.embed_norm(super().forward(ids))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert "model.embed_tokens" in auto_plan(model, 2, sequence_parallel=False).styles
    plain = model.model.embed_tokens
    model.model.embed_tokens = NormedEmbedding(plain.num_embeddings, plain.embedding_dim)
    plan = auto_plan(model, 2, sequence_parallel=False)
    assert "model.embed_tokens" not in plan.styles
    assert "model.embed_tokens: left replicated (it runs embed_norm on the lookup itself)" in plan.notes
    assert plan.head == "lm_head"  # not tied to it: still split
