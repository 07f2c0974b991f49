"""A GPT whose MLPs are Mixtures of Experts, written to be read top to bottom.

The attention is the GPT recipe's (``recipes.gpt.model``); the MLP of every ``moe_every``-th
block is ``lightning_parallel.experts.MoE``, the others stay dense. No parallelism here: the
strategy shards this plain module from the outside (experts over the expert-parallel ranks).

Shape legend for the comments:
    B: batch size           T: sequence length (<= block_size)
    C: n_embd               V: vocab_size
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from lightning_parallel.experts import MoE
from recipes.gpt.model import MLP, CausalSelfAttention, GPTConfig


@dataclass
class MoEGPTConfig(GPTConfig):
    """GPT shape plus the experts; see ``GPTConfig`` for the inherited fields."""

    num_experts: int = 8
    """Routed experts per MoE block."""
    top_k: int = 2
    """Experts each token is sent to (1: Switch Transformer, 2: GShard / Mixtral)."""
    expert_hidden: int | None = None
    """Hidden width of one expert; ``None``: 4 * n_embd, the dense MLP's."""
    capacity_factor: float | None = 1.25
    """Slots per expert relative to an even split; overflow is dropped. ``None``: dropless."""
    normalize_top_k: bool = True
    """Renormalise the chosen experts' probabilities to sum to 1 (GShard/Mixtral; not for top_k=1)."""
    moe_every: int = 1
    """Every ``moe_every``-th block (counting from the last) has an MoE; the others a dense MLP."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss (per MoE block, summed)."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE)."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """Expert activation; ``gelu`` as the dense GPT-2 MLP."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_every < 1:
            raise ValueError(f"`moe_every={self.moe_every}` must be at least 1. Change `--model.moe_every`.")

    @property
    def expert_width(self) -> int:
        return self.expert_hidden or 4 * self.n_embd

    def is_moe(self, layer: int) -> bool:
        return (self.n_layer - 1 - layer) % self.moe_every == 0


class MoEBlock(nn.Module):
    """Pre-norm transformer block with an MoE (or dense) MLP: x + attn(ln(x)), x + mlp(ln(x))."""

    def __init__(self, config: MoEGPTConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.is_moe(layer):
            self.mlp: nn.Module = MoE(
                config.n_embd,
                config.expert_width,
                config.num_experts,
                config.top_k,
                capacity_factor=config.capacity_factor,
                normalize_top_k=config.normalize_top_k,
                activation=config.activation,
                bias=config.bias,
                aux_loss_coef=config.aux_loss_coef,
                z_loss_coef=config.z_loss_coef,
            )
        else:
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C); tokens dropped by the MoE keep x unchanged
        return x


class MoEGPT(nn.Module):
    """Token + position embeddings, ``n_layer`` MoE blocks, final LayerNorm, tied LM head.

    ``forward`` returns logits; the LightningModule adds the MoE auxiliary losses to its loss.
    """

    def __init__(self, config: MoEGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([MoEBlock(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        # GPT-2: projections writing into the residual stream get std 0.02 / sqrt(2 * n_layer)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight", "experts.w_out")):
                nn.init.normal_(param, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2 initialisation for every weight matrix, the experts' stacked ones included."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, MoE):
            nn.init.normal_(module.router.weight, mean=0.0, std=0.02)
            nn.init.normal_(module.experts.w_in, mean=0.0, std=0.02)
            nn.init.normal_(module.experts.w_out, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, V)`` for token ids ``idx`` of shape ``(B, T)``."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"Sequence length {T} exceeds the model's block_size={self.config.block_size}.")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)

    def num_params(self, active: bool = False) -> int:
        """Parameters without the position table; ``active=True``: those one token uses.

        Active parameters count ``top_k`` experts of each MoE block instead of all of them: the
        size of the dense model that does the same work per token.
        """
        total = sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()
        if not active:
            return total
        for module in self.modules():
            if isinstance(module, MoE):
                per_expert = sum(p[0].numel() for p in module.experts.parameters())
                total -= per_expert * (module.num_experts - module.top_k)
        return total
