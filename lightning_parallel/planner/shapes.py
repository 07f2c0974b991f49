"""What the planner needs to know of a model, read from the unchanged module (built on the meta device).

Everything the memory and time models use is here, in plain numbers: the block stack with each
block's widths (attention heads and k/v heads, head size, MLP width, gated or not, routed experts
and top-k) and parameter counts, and the parameters outside the blocks (embeddings before the
first block, final norm and head after the last). :func:`describe` reads them with the same
discovery the tensor-parallel plans and the pipeline cut use (``plans/detect.py``,
``experts.find_moe_blocks``), so the planner sees the model as the strategy will.
:meth:`ModelShape.gpt` builds the same description from a paper's table (layers, width, heads,
vocabulary), for the published runs the time model is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from lightning_parallel.experts import find_moe_blocks
from lightning_parallel.planner.probe import saved_per_token
from lightning_parallel.plans.detect import (
    block_names,
    containers_in,
    find_block_stack,
    find_output_head,
    find_token_embedding,
    head_count,
    head_dim_of,
    kv_head_count,
    norms_in,
)
from lightning_parallel.tensor_parallel.styles import is_projection, projection_dims

__all__ = ["BlockShape", "ModelShape", "describe"]


@dataclass(frozen=True)
class BlockShape:
    """One transformer block, as numbers."""

    hidden: int
    """Width of the residual stream."""
    heads: int
    """Query heads (0: no attention found)."""
    kv_heads: int
    """Key/value heads (= ``heads`` without grouped-query attention)."""
    head_dim: int
    ffn_hidden: int
    """Inner width of the MLP (of one expert under MoE)."""
    gated: bool
    """SwiGLU-style MLP: gate and up projections multiplied (three matrices), else two."""
    parameters: int
    """Elements of all the block's parameters."""
    expert_parameters: int = 0
    """Elements of the routed experts' parameters (part of ``parameters``)."""
    num_experts: int = 0
    """Routed experts (0: a dense MLP)."""
    top_k: int = 0
    """Experts each token meets (0: dense)."""
    norms: int = 2
    """Normalisation layers of the block."""
    norm_statistics: int = 2
    """fp32 numbers a norm keeps per token for backward: 2 for LayerNorm (mean, 1/std), 1 for RMSNorm."""
    norm_fused: bool = True
    """torch's own norm (one kernel keeps the input); a norm written in Python (Hugging Face's RMSNorm)
    also keeps its normalised output for the weight's multiply."""
    attention: str = "flash"
    """``"eager"`` when the model computes softmax scores itself (Hugging Face ``attn_implementation="eager"``)."""
    mlp_saved: tuple[float, float] | None = None
    """(float elements, other bytes) the dense MLP saves per token, probed on the meta device (``probe.py``)."""
    norm_saved: tuple[float, float] | None = None
    """The same for one of the block's norms."""
    attention_entries: int = 1
    """Projections reading the attention's input (separate q, k, v: 3; one fused q|k|v: 1). Under autocast
    each keeps its own 16-bit copy of the input."""
    mlp_entries: int = 1
    """Projections reading the MLP's input (separate gate and up: 2)."""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def _matmul_weights(self, routed_experts: float) -> float:
        """Attention's and the MLP's weight elements with ``routed_experts`` experts' MLPs (and the router)."""
        attention = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn_hidden
        if not self.num_experts:
            return attention + mlp
        return attention + mlp * routed_experts + self.hidden * self.num_experts  # + the router

    @property
    def matmul_weights_per_token(self) -> float:
        """Weight elements of the matrices one token multiplies with (routed experts: top-k of them)."""
        return self._matmul_weights(self.top_k)

    def matmul_weights_held(self, expert_parallel: int) -> float:
        """Weight elements of the block's matrices one rank holds (before tensor parallelism): every routed expert
        divided over the ``expert_parallel`` ranks, where :attr:`matmul_weights_per_token` counts a token's top-k."""
        return self._matmul_weights(self.num_experts / max(min(expert_parallel, self.num_experts), 1))

    def forward_flops_per_token(self, sequence_length: int) -> float:
        """2 FLOPs per multiply-add of every matrix, plus scores and weighted sum (causal counted in full)."""
        return 2.0 * self.matmul_weights_per_token + 4.0 * sequence_length * self.q_width


@dataclass(frozen=True)
class ModelShape:
    """A decoder as the planner sees it: blocks, and what lies before and after them."""

    blocks: tuple[BlockShape, ...]
    vocab_size: int
    hidden: int
    pre_parameters: int
    """Elements of the parameters before the first block (token and position embeddings)."""
    post_parameters: int
    """Elements of the parameters after the last block, a head tied to the embedding not counted again."""
    tied_head: bool
    """The output head is the token embedding's matrix (GPT-2): held by the first and the last stage."""
    head_weights: int = 0
    """Elements of the output head's matrix (``hidden x vocab``), tied or not: its matmul FLOPs."""
    name: str = ""
    parameter_names: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def parameters(self) -> int:
        return self.pre_parameters + sum(b.parameters for b in self.blocks) + self.post_parameters

    def forward_flops_per_token(self, sequence_length: int) -> float:
        """Model FLOPs of one token's forward (the convention of ``plans/flops.py``: head included)."""
        blocks = sum(b.forward_flops_per_token(sequence_length) for b in self.blocks)
        return blocks + 2.0 * self.head_weights

    @classmethod
    def gpt(
        cls,
        layers: int,
        hidden: int,
        heads: int,
        vocab_size: int,
        *,
        ffn_hidden: int | None = None,
        kv_heads: int | None = None,
        gated: bool = False,
        tied_head: bool = True,
        sequence_length: int = 2048,
        num_experts: int = 0,
        top_k: int = 0,
        bias: bool = True,
        name: str = "",
    ) -> ModelShape:
        """A GPT of a paper's table: pre-norm blocks, learned positions (``sequence_length`` of them)."""
        ffn = ffn_hidden or 4 * hidden
        kv = kv_heads or heads
        head_dim = hidden // heads
        b = 1 if bias else 0
        attention = (
            hidden * (hidden + 2 * kv * head_dim) + hidden * hidden + b * (2 * hidden + 2 * kv * head_dim)
        )
        mlp = (3 if gated else 2) * hidden * ffn + b * (ffn + hidden)
        experts = mlp * num_experts if num_experts else 0
        router = hidden * num_experts if num_experts else 0
        norms = 2 * hidden * (1 + b)
        params = attention + (experts + router if num_experts else mlp) + norms
        block = BlockShape(hidden, heads, kv, head_dim, ffn, gated, params, experts, num_experts, top_k)
        pre = vocab_size * hidden + sequence_length * hidden
        post = hidden * (1 + b) + (0 if tied_head else vocab_size * hidden)
        return cls((block,) * layers, vocab_size, hidden, pre, post, tied_head, vocab_size * hidden, name)

    def with_layers(self, layers: int) -> ModelShape:
        return replace(self, blocks=(self.blocks[0],) * layers)


# ---- reading a module --------------------------------------------------------------------------


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_shape(block: nn.Module, expert_params: int, num_experts: int, top_k: int) -> BlockShape:
    containers = containers_in(block)
    attention = next((c for c in containers if c.looks_like_attention()), None)
    hidden = heads = kv_heads = head_dim = ffn = 0
    gated = False
    if attention is not None:
        q_width_total, hidden = projection_dims(attention.exit[1])
        heads = head_count(attention.module) or head_count(block) or 1
        head_dim = head_dim_of(attention.module) or q_width_total // heads
        kv_heads = kv_head_count(attention.module) or kv_head_count(block) or heads
        if heads * head_dim != q_width_total:  # the attribute counted something else
            heads = q_width_total // head_dim
    mlps = (
        [c for c in containers if c is not attention and not c.name.startswith(attention.name + ".")]
        if attention
        else containers
    )
    if mlps:
        mlp = mlps[0]
        entries = [m for _, m in mlp.entries]
        ffn = projection_dims(mlp.exit[1])[0]
        hidden = hidden or projection_dims(mlp.exit[1])[1]
        gated = len(entries) >= 2 or any(projection_dims(m)[1] == 2 * ffn for m in entries)
    skip = {c.name for c in containers}
    norm_names = norms_in(block, skip)
    statistics, fused, norm_saved = 2, True, None
    if norm_names:
        norm = block.get_submodule(norm_names[0])
        statistics = 2 if isinstance(norm, nn.LayerNorm) else 1
        fused = isinstance(norm, (nn.LayerNorm, nn.RMSNorm))
        norm_saved = _probe(norm, hidden)
    # Probed only as a module of its own: projections sitting on the block itself would probe attention too.
    mlp_saved = _probe(mlps[0].module, hidden) if mlps and mlps[0].name and not num_experts else None
    return BlockShape(
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=ffn,
        gated=gated,
        parameters=_numel(block),
        expert_parameters=expert_params,
        num_experts=num_experts,
        top_k=top_k,
        norms=max(len(norm_names), 1),
        norm_statistics=statistics,
        norm_fused=fused,
        attention=_attention_kind(block),
        attention_entries=len(attention.entries) if attention is not None else 1,
        mlp_entries=len(mlps[0].entries) if mlps else 1,
        mlp_saved=mlp_saved,
        norm_saved=norm_saved,
    )


def _probe(module: nn.Module, width: int) -> tuple[float, float] | None:
    saved = saved_per_token(module, width) if width else None
    return (saved.float_elements, saved.other_bytes) if saved is not None else None


def _attention_kind(block: nn.Module) -> str:
    """``"eager"`` where a Hugging Face config asks for its hand-written attention; ``"flash"`` otherwise."""
    for module in block.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "eager":
            return "eager"
    return "flash"


def describe(model: nn.Module, name: str = "") -> ModelShape:
    """The model's shape, from the module as built (on the meta device for large ones)."""
    stack = find_block_stack(model)
    if stack is None:
        raise ValueError(
            f"The planner reads the model as a stack of repeated blocks, but {type(model).__name__} has no"
            " nn.ModuleList of same-class modules."
        )
    names = block_names(model)
    moe = {info.name: info for info in find_moe_blocks(model)}
    blocks = []
    for block_name in names:
        block = model.get_submodule(block_name)
        info = next((i for n, i in moe.items() if n == block_name or n.startswith(block_name + ".")), None)
        if info is None:
            blocks.append(_block_shape(block, 0, 0, 0))
            continue
        expert_params = sum(model.get_parameter(p).numel() for p in info.expert_param_names)
        shape = _block_shape(block, expert_params, info.num_experts, info.top_k or 1)
        width, gated = _expert_width(info.experts, shape.hidden)
        blocks.append(
            replace(shape, ffn_hidden=width or shape.ffn_hidden, gated=gated if width else shape.gated)
        )
    block_ids = {id(p) for b in names for p in model.get_submodule(b).parameters()}
    order = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())  # tied parameters once, under their first name
    first_block_param = next(n for n in order if id(params[n]) in block_ids)
    pre = post = 0
    before = True
    for param_name in order:
        param = params[param_name]
        if id(param) in block_ids:
            before = False
            continue
        if before or param_name == first_block_param:
            pre += param.numel()
        else:
            post += param.numel()
    embedding = find_token_embedding(model, stack.name)
    vocab = embedding[1].num_embeddings if embedding else 0
    head = find_output_head(model, vocab, stack.name) if vocab else None
    tied = bool(embedding and head and head[1].weight is embedding[1].weight)
    hidden = blocks[0].hidden or (embedding[1].embedding_dim if embedding else 0)
    head_weights = head[1].weight.numel() if head else 0
    return ModelShape(
        tuple(blocks),
        vocab,
        hidden,
        pre,
        post,
        tied,
        head_weights,
        name or type(model).__name__,
        tuple(order),
    )


def _expert_width(experts: nn.Module, hidden: int) -> tuple[int, bool]:
    """Inner width of one expert and whether it is gated: from its projections, or stacked ``(E, ., .)`` weights."""
    widths = []
    for module in experts.modules():
        if is_projection(module):
            inputs, outputs = projection_dims(module)
            widths.append(outputs if inputs == hidden else inputs)
    if not widths:
        for param in experts.parameters():
            if param.dim() == 3:
                widths += [d for d in param.shape[1:] if d != hidden]
    if not widths:
        return 0, False
    width = min(widths)
    gated = widths.count(width) >= 3 or 2 * width in widths  # gate, up (or gate|up fused), down
    return width, gated
