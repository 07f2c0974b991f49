"""The LightningModule of the MoE recipe, written as any Lightning user would write it.

The same loss, optimizer and schedule as the GPT recipe (``recipes.gpt.module``), plus the MoE
auxiliary losses, which the user adds to the task loss in ``training_step``
(``moe_aux_loss(self.model)``: each MoE layer's weighted load-balancing and z-losses of this
forward, taken once). Nothing here knows about parallelism.
"""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.text import Perplexity

from lightning_parallel.experts import moe_aux_loss
from recipes.gpt.callbacks import StepFlops
from recipes.gpt.module import warmup_cosine_scheduler
from recipes.gpt.tokenizer import PADDED_VOCAB_SIZE
from recipes.moe.model import MoEGPT, MoEGPTConfig


class MoEGPTLightningModule(StepFlops, L.LightningModule):
    """Next-token prediction with a GPT-MoE; the defaults are the ``tiny.yaml`` model.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias: the GPT shape
            (``recipes.gpt.module.GPTLightningModule``).
        num_experts: Routed experts per MoE block.
        top_k: Experts per token.
        expert_hidden: Hidden width of one expert (``None``: 4 * n_embd).
        capacity_factor: Expert capacity relative to an even split; ``None``: dropless.
        normalize_top_k: Renormalise the top-k probabilities (set False with ``top_k=1``).
        moe_every: Every ``moe_every``-th block is MoE, the others dense.
        aux_loss_coef: Weight of the load-balancing loss.
        z_loss_coef: Weight of the router z-loss.
        activation: Expert activation, ``gelu`` or ``swiglu``.
        learning_rate, min_lr_ratio, weight_decay, betas, warmup_steps, lr_decay_steps, eps:
            AdamW and the warmup + cosine schedule, as the GPT recipe.
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
        num_experts: int = 4,
        top_k: int = 2,
        expert_hidden: int | None = None,
        capacity_factor: float | None = 1.25,
        normalize_top_k: bool = True,
        moe_every: int = 1,
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.001,
        activation: Literal["gelu", "swiglu"] = "gelu",
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
        self.model = MoEGPT(
            MoEGPTConfig(
                vocab_size=vocab_size,
                block_size=block_size,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                dropout=dropout,
                bias=bias,
                num_experts=num_experts,
                top_k=top_k,
                expert_hidden=expert_hidden,
                capacity_factor=capacity_factor,
                normalize_top_k=normalize_top_k,
                moe_every=moe_every,
                aux_loss_coef=aux_loss_coef,
                z_loss_coef=z_loss_coef,
                activation=activation,
            )  # fmt: skip
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
        aux = moe_aux_loss(self.model)  # load balancing + z-loss of every MoE block, weighted
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_aux_loss", aux)
        return loss + aux

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch  # (B, T), (B, T)
        logits = self.model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.val_ppl(logits.float(), y)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self) -> dict:
        """AdamW with decay on weight matrices only, and a warmup + cosine schedule per step.

        Biases and norm gains are not decayed (as in GPT-2); the experts' stacked biases
        (``experts.b_in``/``b_out``, 2-D) are biases too.
        """
        hp = self.hparams
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        is_bias = [p.dim() < 2 or n.endswith(("experts.b_in", "experts.b_out")) for n, p in named]
        groups = [
            {
                "params": [p for (_, p), b in zip(named, is_bias, strict=True) if not b],
                "weight_decay": hp.weight_decay,
            },
            {"params": [p for (_, p), b in zip(named, is_bias, strict=True) if b], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps)
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine_scheduler(optimizer, hp, self)}
