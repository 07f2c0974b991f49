"""The LightningModule of the GPT recipe, written as any Lightning user would write it.

Loss, metrics, optimizer and schedule live here; the network lives in ``model.py``. Nothing
in this file knows about parallelism: the project's strategy shards ``self.model`` after
``__init__`` and Lightning calls ``configure_optimizers`` on the sharded parameters.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics.text import Perplexity

from recipes.gpt.callbacks import StepFlops
from recipes.gpt.model import GPT, GPTConfig
from recipes.gpt.tokenizer import PADDED_VOCAB_SIZE


def warmup_cosine_scheduler(optimizer: torch.optim.Optimizer, hp: Any, module: L.LightningModule) -> dict:
    """Lightning's ``lr_scheduler`` entry: :func:`warmup_cosine` per step, over ``hp.lr_decay_steps``
    or, when that is None, the whole run (``module.trainer.estimated_stepping_batches``)."""
    decay_steps = hp.lr_decay_steps
    if decay_steps is None:
        decay_steps = module.trainer.estimated_stepping_batches
        if not math.isfinite(decay_steps):
            raise ValueError(
                "The training length is unbounded, so the cosine schedule has no end. Set"
                " `--trainer.max_steps` (or `max_epochs`), or `--model.lr_decay_steps`."
            )
    schedule = partial(
        warmup_cosine,
        warmup_steps=hp.warmup_steps,
        decay_steps=int(decay_steps),
        min_lr_ratio=hp.min_lr_ratio,
    )
    return {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"}


def warmup_cosine(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step``.

    Linear warmup over ``warmup_steps`` (never exactly 0, so the first step learns), then a
    cosine from 1 down to ``min_lr_ratio`` at ``decay_steps``, then flat (nanoGPT's schedule).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)  # 0 -> 1
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))


class GPTLightningModule(StepFlops, L.LightningModule):
    """Next-token prediction with a GPT; the defaults are the ``tiny.yaml`` model.

    Args:
        vocab_size: Embedding rows; 320 = the 256 byte tokens padded to a multiple of 64.
        block_size: Longest sequence (position embeddings). The CLI copies it to the data.
        n_layer: Transformer blocks.
        n_head: Attention heads; must divide ``n_embd``.
        n_embd: Model width.
        dropout: Dropout probability; 0 for pretraining.
        bias: Biases in linear layers and LayerNorms.
        learning_rate: Peak learning rate, reached at the end of warmup.
        min_lr_ratio: Final learning rate as a fraction of the peak.
        weight_decay: AdamW decay for matrices and embeddings (not for biases and norms).
        betas: AdamW betas; 0.95 for the second moment is the usual choice for GPTs.
        warmup_steps: Optimizer steps of linear warmup.
        lr_decay_steps: Step at which the cosine reaches ``min_lr_ratio``; ``None`` uses the
            trainer's total number of optimizer steps.
        eps: AdamW's epsilon.
    """

    def __init__(
        self,
        vocab_size: int = PADDED_VOCAB_SIZE,
        block_size: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        bias: bool = True,
        learning_rate: float = 3e-4,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        lr_decay_steps: int | None = None,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(
            GPTConfig(
                vocab_size=vocab_size,
                block_size=block_size,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                dropout=dropout,
                bias=bias,
            )
        )
        self.val_ppl = Perplexity()
        self.count_flops(
            self.model, block_size
        )  # flops_per_batch: TFLOP/s and MFU (recipes/gpt/callbacks.py)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, V)`` for token ids ``(B, T)``."""
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self.model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch  # (B, T), (B, T)
        logits = self.model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        # float: under bf16-mixed the logits are bf16, too coarse for exp(mean log-prob).
        self.val_ppl(logits.float(), y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self) -> dict:
        """AdamW with decay on 2-D+ tensors only, and a warmup + cosine schedule per step.

        Biases and LayerNorm gains are 1-D; decaying them towards 0 only hurts, so they get
        ``weight_decay=0`` (as in GPT-2 / nanoGPT). The tied embedding appears once here.
        """
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps)
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine_scheduler(optimizer, hp, self)}

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``(B, T)``; returns ``(B, T + new)``.

        ``temperature=0`` is greedy decoding; ``top_k`` keeps only the k likeliest tokens.
        Call ``eval()`` first if the model has dropout. No KV cache: each step re-reads the
        last ``block_size`` tokens, which is simple and fast enough for samples.
        """
        block_size = self.model.config.block_size
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -block_size:]  # (B, <=block_size)
            logits = self.model(idx_cond)[:, -1, :]  # (B, V)
            if temperature <= 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)  # (B, V)
                idx_next = torch.multinomial(probs, num_samples=1)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)  # (B, T + 1)
        return idx
