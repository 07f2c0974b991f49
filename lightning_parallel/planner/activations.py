"""Activation bytes held for backward: per block and token from the block's real widths, and how many
micro-batches a pipeline schedule keeps in flight.

The per-layer terms of Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4), written from the block's widths instead of ``34 s b h + 5 a s^2 b``,
so that grouped-query attention, gated MLPs (SwiGLU), routed experts, fused attention and the
project's own checkpointing modes each get their own terms. Each term is a tensor autograd saves
(what :class:`~lightning_parallel.memory.counting.SavedTensorCounter` counts, one storage once):

- a norm keeps its input and its statistics (fp32: 2 per token for LayerNorm, 1 for RMSNorm),
  and a norm written in Python also its normalised output;
- a projection keeps its input (q, k and v share one; gate and up share one);
- fused attention keeps q, k, v, its output (laid out as the exit projection reads it, so one
  storage with the exit's input) and the log-sum-exp per head; eager attention the softmax
  scores (``heads x s`` per token) and an output the exit reads through a copy;
- the MLP keeps the activation's input and the exit projection's input (dense), or gate, up,
  their product's inputs and the exit's input (gated: 4 widths);
- where the module runs on the meta device, a dense MLP's and a norm's terms are instead what they
  really save (``probe.py``): activation functions and norms written in Python keep more;
- routed experts hold, for ``top_k`` copies of every token, its input, those MLP terms, the expert's
  output and its weighted copy; the router keeps its input and per-expert scores.

Under ``*-mixed`` precision a projection keeps the 16-bit copy autocast made of its input; projections
reading one input (q, k, v; gate, up) share one copy, and no copy of a weight is kept (``memory/casts.py``).
Under sequence parallelism an entry's input, gathered over the tensor ranks, is kept as the rank's slice
and gathered again in backward (``memory/regather.py``; a routed-experts block reads its slice ungathered).
The last stage keeps, for the loss, fp32 log-probabilities over the whole vocabulary, or under tensor
parallelism (the default ``loss_parallel``) its shard of the logits and a log-sum-exp per token.
Under tensor parallelism the widths split ``tp`` ways; the residual stream (norm inputs) splits too
only under sequence parallelism. ``"full"`` checkpointing keeps each block's input; ``"selective"``
keeps the block input and the outputs of matmuls and attention kernels (``memory/checkpointing.py``), with
policy ``"ops_alternate_matmuls"`` only every second projection's output (dense blocks; routed experts run
their matmuls in the order the router sends tokens, and are counted as under ``"ops"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.config.arguments import resolve_schedule
from lightning_parallel.pipeline.schedule_actions import Action, rank_actions
from lightning_parallel.planner.layout import PRECISIONS, Layout
from lightning_parallel.planner.shapes import BlockShape, ModelShape

__all__ = [
    "ActivationEstimate",
    "block_bytes_per_token",
    "held_at_peak",
    "loss_bytes_per_token",
    "projection_outputs",
    "stage_activation_bytes",
]

_INDEX_BYTES = 8  # token ids kept by the embedding lookup
_SHARDED_LOSS_INDICES = 8 + 1 + 1  # per token: the local target index, the on-this-rank and valid flags


def _bytes(layout: Layout) -> tuple[int, int]:
    """(bytes of an activation, bytes of the residual stream): autocast leaves the residual stream fp32."""
    _, activation, _ = PRECISIONS[layout.precision]
    residual = 4 if layout.precision.endswith("-mixed") else activation
    return activation, residual


def _stored(nbytes: float, layout: Layout) -> float:
    """Bytes an element of a floating-point tensor saved for backward takes as the saver stores it
    (``activation_compression``: bf16 halves fp32, fp8 keeps one byte; ``memory/stored.py``)."""
    if layout.activation_compression == "bf16":
        return min(nbytes, 2)
    if layout.activation_compression == "fp8":
        return min(nbytes, 1)
    return nbytes


def _norm_bytes(block: BlockShape, hidden: int, residual: float, statistic: float = 4) -> float:
    """Input, statistics and (a norm written in Python) the normalised copy, per token: probed where it could be."""
    if block.norm_saved is not None:
        elements, other = block.norm_saved
        return elements * residual + other
    return hidden * residual * (1 if block.norm_fused else 2) + block.norm_statistics * statistic


def projection_outputs(block: BlockShape, q: float, kv: float, ffn: float) -> list[float]:
    """The widths of a block's projection matmul outputs on one rank, in forward order (what the
    ``"ops_alternate_matmuls"`` policy keeps every second of, from the first)."""
    entries = [q, kv, kv] if block.attention_entries >= 3 else [q + 2 * kv]
    if block.gated:
        inner = [ffn, ffn] if block.mlp_entries >= 2 else [2 * ffn]
    else:
        inner = [ffn]
    return [*entries, block.hidden, *inner, block.hidden]


def block_bytes_per_token(
    block: BlockShape, layout: Layout, mode: str | None = None, *, sliced_inputs: bool = True
) -> float:
    """Bytes one token's pass through ``block`` holds for backward on one rank (``mode``: checkpointing).

    ``sliced_inputs``: under sequence parallelism the entries' gathered inputs are held as this rank's slice
    (``memory/regather.py``); a block recomputed in backward holds them whole (checkpointing's own saves).
    """
    tp = layout.tensor_parallel
    act, residual = _bytes(layout)
    # what the saver stores (compression); a gathered input kept as a slice and selective recomputation's kept
    # outputs are stored as they are
    kept, kept_residual, statistic = _stored(act, layout), _stored(residual, layout), _stored(4, layout)
    sp = tp if layout.sequence_parallel else 1
    # k/v heads fewer than ranks: each rank keeps one whole head (plans/auto.py's row layouts)
    kv = max(block.kv_heads // tp, 1) * block.head_dim if block.kv_heads else block.kv_width / tp
    h, q = block.hidden, block.q_width / tp
    heads = block.heads / tp
    ffn = block.ffn_hidden / tp
    experts = block.top_k if block.num_experts else 1
    if mode == "full":
        return _block_input(block, layout)
    if mode == "selective":
        # block input (saved); outputs of matmuls and attention kernels (kept as they are)
        router = block.num_experts * 4 if block.num_experts else 0
        kernel = q * act + heads * 4  # the attention kernel's output and log-sum-exp
        if layout.activation_checkpointing_policy == "ops_alternate_matmuls" and not block.num_experts:
            return (
                _block_input(block, layout) + kernel + sum(projection_outputs(block, q, kv, ffn)[::2]) * act
            )
        attention = (q + 2 * kv) * act + kernel + h * act
        mlp = ((2 if block.gated else 1) * ffn + h) * act * experts
        return _block_input(block, layout) + attention + mlp + router
    norms = block.norms * _norm_bytes(block, h, kept_residual, statistic) / sp
    # Each projection keeps its input; under autocast a 16-bit copy of it, one shared by all reading it;
    # gathered over the sequence shards (sp), this rank's slice of it (stored as it is: never compressed).
    entry = h / (sp if sliced_inputs else 1)
    entry_bytes = entry * (act if sp > 1 else kept)
    attention = entry_bytes + (q + 2 * kv) * kept + q * kept  # entry input(s), q|k|v, exit input
    if layout.attention == "flash" and block.attention == "flash":  # output laid out as the exit reads it
        attention += heads * statistic  # log-sum-exp
    else:
        attention += heads * layout.sequence_length * kept + q * kept  # softmax scores, the output
    if block.mlp_saved is not None and not block.num_experts:  # probed: its input, the rest of inner width
        elements, other = block.mlp_saved
        return norms + attention + entry_bytes + (elements - h) / tp * kept + other / tp
    mlp = ((4 if block.gated else 2) * ffn) * kept
    if block.num_experts:  # experts are whole on every tensor rank (plans/auto.py): their width is not split
        # per routed copy: its input, the expert's terms, its output and the weighted output
        mlp = (4 if block.gated else 2) * block.ffn_hidden * kept
        mlp = (mlp + 3 * h * kept) * experts + h * kept + block.num_experts * 16  # + router input, scores
        mlp /= sp  # under sequence parallelism each rank routes its slice of the sequence (plans/auto.py)
    return norms + attention + (h / sp * kept if block.num_experts else entry_bytes) + mlp


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of one pipeline stage (the whole model without stages) on one rank."""

    per_micro_batch: float
    """Held for backward by one micro-batch's forward, on the device."""
    host_per_micro_batch: float
    """Held for backward in host memory by one micro-batch's forward (``activation_offload``)."""
    recompute_working_set: float
    """Extra bytes during one block's recomputation (checkpointing): that block's full activations."""


def held_at_peak(layout: Layout, pp_rank: int, per_micro_batch: dict[int, float]) -> dict[int, int]:
    """Micro-batches each stage of pipeline rank ``pp_rank`` holds for backward when the rank holds the most
    (``per_micro_batch``: bytes one micro-batch's forward leaves on each of its stages, by stage index).

    GPipe and looped BFS run every forward first (M). 1F1B keeps ``P - r`` (rank r). The multi-stage schedules
    are walked on torch's own action list for the layout (``pipeline/schedule_actions.py``): a forward adds its
    micro-batch on its stage, its last backward action lets it go (under the zero-bubble schedules its weight
    pass: torch's input pass keeps the graph, whose saved inputs the weight pass reads). Interleaved 1F1B's
    peak is its warm-up, ``(V - 1) P + 2 (P - r - 1) + 1`` chunk-forwards (Narayanan et al. 2021), most of them
    on its first stage; should torch's list not build (another torch), that many spread evenly over the V
    stages. Measured within 1% on two ranks x two stages for interleaved 1F1B, ZB-V, interleaved zero bubble
    and DualPipe-V (``tests/planner/test_memory_exact.py``).
    """
    p, m, v = layout.pipeline_parallel, layout.micro_batches, layout.pipeline_virtual_stages
    spec = resolve_schedule(layout.pipeline_schedule)
    if p == 1:
        return dict.fromkeys(per_micro_batch, 1)
    if spec.name in ("gpipe", "looped_bfs"):
        return dict.fromkeys(per_micro_batch, m)
    if not spec.multi_stage:
        return dict.fromkeys(per_micro_batch, min(p - pp_rank, m))
    try:
        actions = rank_actions(spec, p, v, m)[pp_rank]
    except Exception:  # noqa: BLE001 - an estimate is better than no plan
        warmup = min((v - 1) * p + 2 * (p - pp_rank - 1) + 1, m * v)
        return dict.fromkeys(per_micro_batch, -(-warmup // v))
    return _walk(actions, per_micro_batch)


_BACKWARDS = ("FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")


def _walk(actions: tuple[Action, ...], per_micro_batch: dict[int, float]) -> dict[int, int]:
    last_backward = {(a.stage, a.micro_batch): i for i, a in enumerate(actions) if a.kind in _BACKWARDS}
    held = dict.fromkeys(per_micro_batch, 0)
    best, best_bytes, alive = dict(held), 0.0, 0.0
    for i, action in enumerate(actions):
        if action.kind == "FORWARD":
            held[action.stage] += 1
            alive += per_micro_batch[action.stage]
            if alive > best_bytes:
                best, best_bytes = dict(held), alive
        elif last_backward.get((action.stage, action.micro_batch)) == i:
            held[action.stage] -= 1
            alive -= per_micro_batch[action.stage]
    return best


def stage_activation_bytes(
    shape: ModelShape, layout: Layout, blocks: range, *, first: bool, last: bool
) -> ActivationEstimate:
    """Activation bytes of the stage holding ``blocks`` (with the embeddings when ``first``, head when ``last``)."""
    tokens = layout.local_tokens
    mode = layout.activation_checkpointing
    act, residual = _bytes(layout)
    tp = layout.tensor_parallel
    sp = tp if layout.sequence_parallel else 1
    per_block = [block_bytes_per_token(shape.blocks[i], layout, mode) for i in blocks]
    per_token = sum(per_block)
    host = 0.0
    if layout.activation_offload and len(per_block) > 1:  # the last block (and what follows it) stays
        stays = [
            _stays_on_device(shape.blocks[i], layout, mode, whole)
            for i, whole in zip(blocks, per_block, strict=True)
        ]
        host = sum(per_block[:-1]) - sum(stays[:-1])
    if first:
        per_token += _INDEX_BYTES
    if last:  # final norm, head input, what the loss keeps: of this rank's tokens (under context parallelism
        # too: context_parallel/local_tokens.py runs the head and the loss on each rank's tokens)
        norm = shape.blocks[-1]
        kept_residual, statistic = _stored(residual, layout), _stored(4, layout)
        # gathered under sp: a slice, kept as it is
        head_input = shape.hidden * (act if sp > 1 else _stored(act, layout))
        exit_bytes = _norm_bytes(norm, shape.hidden, kept_residual, statistic) / sp + head_input
        per_token += exit_bytes + loss_bytes_per_token(shape, layout)
    working = 0.0
    if mode and blocks:
        working = (
            max(block_bytes_per_token(shape.blocks[i], layout, sliced_inputs=False) for i in blocks) * tokens
        )
    return ActivationEstimate((per_token - host) * tokens, host * tokens, working)


def _stays_on_device(block: BlockShape, layout: Layout, mode: str | None, whole: float) -> float:
    """What of ``whole``, one token's bytes of ``block``, the offloading saver leaves on the device: the gathered
    inputs kept as slices (no checkpointing, a dense block, sequence parallelism) and what selective
    recomputation keeps outside saved tensors (all but the block input)."""
    if mode == "full":
        return 0.0
    if mode == "selective":
        return whole - _block_input(block, layout)
    if layout.sequence_parallel and layout.tensor_parallel > 1 and not block.num_experts:
        return 2 * _entry_slice(block, layout)  # the attention's and the MLP's entry inputs
    return 0.0


def _block_input(block: BlockShape, layout: Layout) -> float:
    """One token's bytes of a block's input as saved: the residual stream (this rank's slice under sp)."""
    sp = layout.tensor_parallel if layout.sequence_parallel else 1
    return block.hidden * _stored(_bytes(layout)[1], layout) / sp


def _entry_slice(block: BlockShape, layout: Layout) -> float:
    """One token's bytes of an entry's gathered input kept as this rank's slice (sp): stored as it is."""
    return block.hidden / layout.tensor_parallel * _bytes(layout)[0]


def loss_bytes_per_token(shape: ModelShape, layout: Layout) -> float:
    """What the cross-entropy keeps per token: fp32 log-probabilities over the whole vocabulary (one rank, or
    logits gathered); on the shards of a sharded head (``loss_parallel`` not False), its ``V / tp`` logits
    as the head made them, one fp32 log-sum-exp and the target's place (``tensor_parallel/vocab_loss.py``);
    with ``loss_parallel=True``, torch's fp32 log-probabilities of the shard."""
    tp, vocab = layout.tensor_parallel, shape.vocab_size
    fp32 = _stored(4, layout)
    if tp == 1 or vocab % tp or layout.loss_parallel is False:
        return vocab * fp32
    if layout.loss_parallel:
        return vocab / tp * fp32
    # the shard's logits, a log-sum-exp, the target's place
    return vocab / tp * _stored(_bytes(layout)[0], layout) + fp32 + _SHARDED_LOSS_INDICES
