"""A GPT-2 style decoder-only transformer, written to be read top to bottom.

Attention, then the MLP, then the block that composes them, then the config and the model.
There is no parallelism here on purpose: the project's strategy shards this plain module
(tensor, sequence, pipeline parallel) from the outside, which is the point of the recipe.

Shape legend for the comments:
    B: batch size           T: sequence length (<= block_size)
    C: n_embd               nh: n_head            hs: head size = C // nh
    V: vocab_size
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        # -1, not C: whoever shards the heads changes how many there are, not this line.
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C)
        return self.resid_dropout(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward network: expand 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.fc(x))  # (B, T, 4C)
        return self.dropout(self.proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


@dataclass
class GPTConfig:
    """Shape of the model; the defaults are GPT-2 small with the byte vocabulary padded to 320."""

    vocab_size: int = 320
    """Rows of the embedding and of the LM head. Larger than the tokenizer's vocabulary is
    fine (unused ids are never targets); keep it a multiple of 64 for tensor parallelism."""
    block_size: int = 1024
    """Longest sequence the model accepts: the number of learned position embeddings."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 768
    """Width of the residual stream (model dimension)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches; 0 for pretraining."""
    bias: bool = True
    """Bias in the linear layers and LayerNorms, as in GPT-2. False is slightly faster."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"`n_embd={self.n_embd}` must be divisible by `n_head={self.n_head}` (each head gets"
                f" n_embd // n_head channels). Change `--model.n_embd` or `--model.n_head`."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout={self.dropout}` must be in [0, 1).")


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, tied LM head.

    ``forward`` returns logits, not a loss: the LightningModule owns the loss, so the model
    stays a pure function of token ids that can be split into pipeline stages.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (GPT-2): the input embedding and the output projection share one
        # (V, C) matrix, which saves V * C parameters and helps small models.
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layer),
        # so the residual's variance does not grow with depth (two such writes per block).
        for name, param in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases (LayerNorm keeps 1 and 0)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, V)`` for token ids ``idx`` of shape ``(B, T)``."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"Sequence length {T} exceeds the model's block_size={self.config.block_size}.")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C)
        x = self.transformer.drop(tok_emb + pos_emb)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position embeddings, as GPT-2 reports it.

        The token embedding is counted because it is tied to the LM head, where it does
        real work. ``parameters()`` yields the tied matrix once, so it is not double counted.
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n
