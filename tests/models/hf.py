"""Hugging Face ``transformers`` models in the ten-line LightningModule a user would write.

Built from tiny config objects, never downloaded. The loss is computed in ``training_step``
from the logits (not through ``labels=``), as a user who owns the loss would write it. The
optimizer is SGD with momentum by default, AdamW (``eps=1e-5``) with ``optimizer="adamw"``; see
docs/testing.md for why parity tests prefer SGD.

Attention implementations, chosen on purpose:
- GPT-2 runs ``attn_implementation="eager"``: HF's own hand-written attention (matmul, causal
  mask, softmax), a second manual-attention code path next to nanoGPT's.
- Llama runs ``attn_implementation="sdpa"``: what modern HF models default to, so the suite
  covers ``scaled_dot_product_attention`` under tensor parallelism (see DESIGN.md 4.1), plus
  grouped-query attention (4 query heads, 2 key/value heads) and RoPE.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.models.optim import parity_optimizer


class _CausalLMModule(L.LightningModule):
    """Shared training code; subclasses only build ``self.model``."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self.model(input_ids=x).logits  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return parity_optimizer(self.parameters(), self.hparams.optimizer, self.hparams.learning_rate)


class HFGPT2Module(_CausalLMModule):
    """``GPT2LMHeadModel``: fused ``c_attn`` as ``Conv1D`` (transposed weights), tied ``lm_head``."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 32,
        learning_rate: float | None = None,
        optimizer: str = "sgd",
        n_layer: int = 2,
        attn_implementation: str = "eager",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=vocab_size, n_positions=block_size, n_embd=64, n_layer=n_layer, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            use_cache=False, attn_implementation=attn_implementation,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)


class HFLlamaModule(_CausalLMModule):
    """``LlamaForCausalLM``: separate q/k/v/o and gate/up/down projections, RMSNorm, RoPE, GQA."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 32,
        learning_rate: float | None = None,  # None: 0.1 for SGD, 1e-3 for AdamW
        optimizer: str = "sgd",
        num_key_value_heads: int = 2,
        n_layer: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=64,
            intermediate_size=128, num_hidden_layers=n_layer, num_attention_heads=4,
            num_key_value_heads=num_key_value_heads, bos_token_id=0, eos_token_id=0, pad_token_id=None,
            use_cache=False, attn_implementation="sdpa",
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)


class HFOPTModule(_CausalLMModule):
    """``OPTForCausalLM``: separate q/k/v with biases, learned positions. Its key-projection bias has a
    gradient that is zero in exact arithmetic (softmax ignores a shift shared by every key): the
    verification must not refuse tensor parallelism on that rounding noise."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 32,
        learning_rate: float | None = None,
        optimizer: str = "sgd",
        n_layer: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = OPTConfig(
            vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=64, ffn_dim=128,
            word_embed_proj_dim=64, num_hidden_layers=n_layer, num_attention_heads=4, dropout=0.0,
            attention_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=0, use_cache=False,
            attn_implementation="sdpa",
        )  # fmt: skip
        self.model = OPTForCausalLM(config)


class HFQwen3Module(_CausalLMModule):
    """``Qwen3ForCausalLM``: Llama-like with a per-head RMSNorm on queries and keys (``q_norm``, ``k_norm``
    over ``head_dim``). Under tensor parallelism each rank normalises its own heads with the shared
    weight, whose gradient is then a partial sum over the ranks."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 32,
        learning_rate: float | None = None,
        optimizer: str = "sgd",
        n_layer: int = 2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = Qwen3Config(
            vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=64, intermediate_size=128,
            num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            bos_token_id=0, eos_token_id=0, pad_token_id=None, use_cache=False, attn_implementation="sdpa",
            tie_word_embeddings=False,
        )  # fmt: skip
        self.model = Qwen3ForCausalLM(config)


class HFMixtralModule(_CausalLMModule):
    """``MixtralForCausalLM``: Llama attention plus sparse MoE blocks (router ``gate``, fused experts), top-2."""

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 32,
        learning_rate: float | None = None,
        optimizer: str = "sgd",
        n_layer: int = 2,
        num_experts: int = 4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = MixtralConfig(
            vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=64,
            intermediate_size=96, num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=num_experts, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
            pad_token_id=None, use_cache=False, attn_implementation="sdpa",
        )  # fmt: skip
        self.model = MixtralForCausalLM(config)


class HFGptOssModule(_CausalLMModule):
    """``GptOssForCausalLM``: fused experts with per-expert biases (2-D, ``(E, F)``), a router with a bias,
    attention sinks, sliding and full attention layers (eager: the sinks), top-2 of 4 experts.

    The expert biases start random (HF initialises them to zero), so that a rank using another expert's
    bias row is visible from the first step.
    """

    def __init__(
        self, vocab_size: int = 128, block_size: int = 32, learning_rate: float | None = None,
        optimizer: str = "sgd", n_layer: int = 2, num_experts: int = 4,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        config = GptOssConfig(
            vocab_size=vocab_size, max_position_embeddings=block_size, hidden_size=64, intermediate_size=96,
            num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_local_experts=num_experts, num_experts_per_tok=2, sliding_window=16, bos_token_id=0,
            eos_token_id=0, pad_token_id=None, use_cache=False, attn_implementation="eager",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
        self.model = GptOssForCausalLM(config)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name.endswith("_proj_bias"):
                    param.normal_(0.0, 0.5)


class HFMixtralAuxModule(HFMixtralModule):
    """Mixtral trained on its loss plus the Switch load-balancing loss (x 0.01) of every MoE block.

    In one process the step adds it with ``AuxLossCollector`` (loss mode); under
    ``HybridParallelStrategy(moe_aux_loss_coef=0.01)`` the strategy injects it instead, and the
    step must not add it again: the pair checks that the strategy's aux loss is the same one,
    counted once.
    """

    AUX_COEF = 0.01

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from lightning_parallel.experts import AuxLossCollector

        strategy_adds = getattr(self.trainer.strategy, "moe_aux_loss_coef", None) is not None
        collector = self.__dict__.get("_collector")
        if not strategy_adds and collector is None:
            collector = self.__dict__["_collector"] = AuxLossCollector(self.model, coef=self.AUX_COEF)
        if strategy_adds:
            return super().training_step(batch, batch_idx)
        collector.reset()
        return collector.add_to_loss(super().training_step(batch, batch_idx))


class HFZooModule(_CausalLMModule):
    """A family of the zoo (``tests/models/zoo.py``): ``AutoModelForCausalLM`` of its tiny config, unchanged."""

    def __init__(
        self,
        family: str,
        vocab_size: int = 128,
        block_size: int = 32,
        learning_rate: float | None = None,
        optimizer: str = "sgd",
        n_layer: int = 2,
        **config_overrides: object,
    ) -> None:
        from tests.models.zoo import zoo_config

        super().__init__()
        self.save_hyperparameters()
        self.model = AutoModelForCausalLM.from_config(
            zoo_config(family, vocab_size, block_size, n_layer, **config_overrides)
        )


class HFTinyModule(_CausalLMModule):
    """Any decoder family of the installed ``transformers``: ``AutoModelForCausalLM`` of its tiny config
    (``tests/models/tiny_configs.py``, from the family's own defaults), unchanged; the sweep's module."""

    def __init__(
        self,
        model_type: str,
        vocab_size: int = 128,
        block_size: int = 32,
        learning_rate: float | None = None,
        optimizer: str = "sgd",
        **config_overrides: object,
    ) -> None:
        from tests.models.tiny_configs import tiny_config

        super().__init__()
        self.save_hyperparameters()
        self.model = AutoModelForCausalLM.from_config(tiny_config(model_type, **config_overrides))
