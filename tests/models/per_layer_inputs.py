"""A model whose blocks read, besides the hidden state, inputs made once at model level from weights outside
the blocks (Gemma 3n's and 4's per-layer embeddings; CPM-Ant's learned position bias is the same kind): under
pipeline parallelism those weights live on every stage that reads them, and their gradients are summed.

``share_state=True`` instead hands each block, through a dict, what the block before it computed (keys and
values shared across layers): pipeline stages pass on only the hidden state, and no stage boundary can avoid
every such pair of blocks, so that model is refused. ``share_state="pair"``: only block 1 stores and block 2
reads (as Gemma 3n's last layers reuse what one layer stored): the split keeps the two on one stage.
``mlp=True``: each block also has an MLP tensor parallelism splits, while it adds its per-layer input itself,
per token, on what sequence parallelism makes its slice of the sequence. ``strided_hidden=True``: each block returns its hidden state as a transposed view (the values unchanged, the
strides not), which a point-to-point send and receive cannot take as it is. The model's loop reads each
block's ``kind`` attribute, as Nemotron-H's reads ``block_type``: a stage must answer it for blocks it skips.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from tests.models.optim import parity_optimizer


class _MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(hidden)))


class SideInputBlock(nn.Module):
    kind = "side input"

    def __init__(
        self,
        width: int,
        side: int,
        strided_hidden: bool = False,
        reads: bool = True,
        stores: bool = True,
        mlp: bool = False,
    ) -> None:
        super().__init__()
        self.mix, self.side = nn.Linear(width, width), nn.Linear(side, width)
        self.mlp = _MLP(width) if mlp else None
        self.strided_hidden, self.reads, self.stores = strided_hidden, reads, stores

    def forward(
        self, hidden: torch.Tensor, per_layer: torch.Tensor, shared: dict | None = None
    ) -> torch.Tensor:
        out = hidden + torch.tanh(self.mix(hidden)) + self.side(per_layer)
        if self.mlp is not None:
            out = out + self.mlp(out)
        if shared is not None:
            if self.reads and "kv" in shared:
                out = out + shared["kv"]
            if self.stores:
                shared["kv"] = self.mix(hidden)
        return out.transpose(0, 1).contiguous().transpose(0, 1) if self.strided_hidden else out


class PerLayerInputs(nn.Module):
    def __init__(
        self,
        vocab: int,
        layers: int,
        width: int,
        side: int = 4,
        share_state: bool | str = False,
        strided_hidden: bool = False,
        shared_side: bool = False,
        mlp: bool = False,
    ) -> None:
        super().__init__()
        self.embed, self.per_layer = nn.Embedding(vocab, width), nn.Embedding(vocab, layers * side)
        pair = share_state == "pair"
        self.blocks = nn.ModuleList(
            SideInputBlock(
                width, side, strided_hidden, reads=not pair or i == 2, stores=not pair or i == 1, mlp=mlp
            )
            for i in range(layers)
        )
        if shared_side:  # the first and last blocks call one module (Zamba's shared transformer)
            self.blocks[-1].side = self.blocks[0].side
        self.head, self.side, self.share_state = nn.Linear(width, vocab), side, share_state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        per_layer = self.per_layer(ids).view(*ids.shape, len(self.blocks), self.side)
        shared: dict | None = {} if self.share_state else None
        for index, block in enumerate(self.blocks):
            if block.kind != "side input":  # model-level code reading a block's attribute
                raise RuntimeError(f"block {index} is of kind {block.kind!r}")
            hidden = block(hidden, per_layer[:, :, index], shared=shared)
        return self.head(hidden)


class PerLayerInputsModule(L.LightningModule):
    def __init__(
        self, vocab_size: int = 128, block_size: int = 32, n_layer: int = 4, n_embd: int = 16,
        share_state: bool | str = False, strided_hidden: bool = False, learning_rate: float | None = None,
        optimizer: str = "sgd", shared_side: bool = False, mlp: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.model = PerLayerInputs(
            vocab_size, n_layer, n_embd, share_state=share_state, strided_hidden=strided_hidden,
            shared_side=shared_side, mlp=mlp,
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return parity_optimizer(self.parameters(), self.hparams.optimizer, self.hparams.learning_rate)
