"""One micro-batch on one rank: its compute and the communication that runs in line with it.

:func:`micro_batch` is the part of the time model (``planner/timing.py``) that repeats per micro-batch:

- matmul FLOPs (forward, backward = 2 x forward, recomputation) at ``peak x matmul_efficiency``;
- HBM traffic at ``bandwidth x memory_efficiency``: each matmul's inputs, weights and outputs (a
  ``K x N`` matmul over ``T`` tokens moves ``K + N + K N / T`` elements per token, so thin matmuls,
  small widths per tensor rank or few tokens, run further from the peak), and the memory-bound
  kernels: norms, bias-dropout-residual adds, the MLP activation, fused attention's q/k/v/output,
  eager attention's softmax and dropout over the scores, the cross-entropy over the vocabulary.
  Matmul FLOPs grow with ``hidden^2`` per token and this traffic with ``hidden``: it is why small
  models reach a lower MFU, with one efficiency per chip;
- tensor-parallel collectives, expert all-to-alls and pipeline sends.

Backward moves about twice the forward's bytes (it reads the gradient and the saved input and
writes the input's gradient) and does twice its matmul FLOPs, fused attention's core two and a half times:
it keeps no probabilities, so its backward computes the scores again (five matmuls to the forward's two, as
FlashAttention's and cuDNN's kernels do). Causal attention is counted over the whole score matrix: the
kernels skip the masked half but run below the GEMMs' rate (counting half was worse out of sample:
docs/planner.md). ``"full"`` checkpointing reruns the forward (its tensor-parallel
collectives too); ``"selective"`` reruns the cheap ops only (norms, activations, softmax: the
matmul and attention outputs are kept, ``memory/checkpointing.py``), memory-bound and FLOP-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_parallel.pipeline.schedules import SCHEDULES, stage_owner
from lightning_parallel.pipeline.split import balanced_boundaries, stage_ranges
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.layout import PRECISIONS, Layout
from lightning_parallel.planner.shapes import BlockShape, ModelShape

__all__ = [
    "STRATEGY",
    "Execution",
    "MicroBatch",
    "Stage",
    "all_reduce",
    "all_to_all_time",
    "group_bandwidth",
    "half_ring",
    "matmul_peak",
    "micro_batch",
    "stages",
]

# Memory-bound traffic, in activation elements a kernel reads or writes per token (forward):
_RESIDUAL_PASSES = 11.0  # 2 norms (read, write) + 2 bias-dropout-residual adds (2 reads, 1 write, a mask)
_ATTENTION_PASSES = 2.0  # fused attention: reads q, k, v, writes the output (q and k/v widths)
_MLP_PASSES = 2.0  # activation function: reads and writes the inner width (gated: 3, two inputs)
_SCORE_PASSES = 4.5  # eager attention: softmax (read, write) + dropout (read, write, mask) per score
_PERMUTE_PASSES = 4.0  # MoE: token permutation and its inverse (read, write) per routed copy
# Eager PyTorch, a Llama-style block (``Execution.compiled=False``), beyond the fused passes above, per token:
_EAGER_NORM_PASSES = (
    8.0  # per RMSNorm: to fp32, square, mean, rsqrt-scale, back to 16-bit, gain (4 extra r/w)
)
_EAGER_ROTARY_PASSES = 6.0  # q and k: complex view, multiply, real view, type cast (3 extra read/write pairs)
_EAGER_MLP_PASSES = 2.0  # SwiGLU's activation and product apart (one more read and write of the inner width)
_LOSS_BYTES_PER_LOGIT = 68.0  # unfused fp32 cross-entropy (Megatron's vocab-parallel): ~17 x 4 bytes


@dataclass(frozen=True)
class Execution:
    """How the training code runs a layout beyond its degrees: what it overlaps and what its collectives carry.

    :data:`STRATEGY` is what ``HybridParallelStrategy`` does; the published runs
    (``planner/published.py``) pass what their sources say their code did.
    """

    overlap_tensor_parallel: bool = False
    """Tensor-parallel collectives hidden behind the matmuls (Megatron's ``--tp-comm-overlap``)."""
    overlap_gradient_reduction: bool = True
    """Data-parallel gradient reduction during the last backward, all but its last bucket hidden."""
    overlap_parameter_gather: bool = False
    """ZeRO-1/2's parameter all-gather hidden behind the next forward (Megatron's ``--overlap-param-gather``)."""
    overlap_pipeline_transfers: bool = False
    """Pipeline sends and receives hidden behind compute."""
    split_pipeline_transfers: bool = False
    """Each tensor rank sends 1/tp of the activation between stages (Megatron's scatter/gather; implied by SP)."""
    gradient_bytes: int | None = None
    """Bytes per gradient element the data-parallel reduction carries (None: the precision's)."""
    parameter_bytes: int | None = None
    """Bytes per parameter element ZeRO's all-gathers carry (None: the precision's)."""
    bucket_bytes: float = 25 * 2**20
    """Gradient bucket: the last one is reduced after backward ends (DDP's 25 MiB)."""
    float8_linears: bool = False
    """The blocks' projection matmuls in fp8 (Transformer Engine, torchao's ``Float8Linear``) at the chip's
    fp8 peak, each casting its input and weight (and in backward its output gradient) to fp8 first;
    attention's own matmuls and the output head stay 16-bit."""
    float8_cast_passes: float = 1.5
    """What casting one element to fp8 moves, in 16-bit element reads and writes: 1.5 (read it, write the byte)
    by default; Transformer Engine writes the fp8 copy from the kernel before (norm, activation): 0.5; dynamic
    per-tensor scaling as a separate pass (torchao's ``Float8Linear``) first reads the tensor for its amax: 2.5."""
    compiled: bool | None = None
    """None: as the layout's ``compile`` (the strategy's argument; eager by default). True: memory-bound ops fused
    into few kernels, as Megatron's fused kernels and ``torch.compile`` run them. False:
    eager PyTorch, where a Llama-style block's RMSNorm, rotary embedding and SwiGLU, written in Python in the codes
    that train such models (Hugging Face, torchtitan), run as separate kernels, each reading and writing its tensor
    (:data:`_EAGER_NORM_PASSES`...); GPT-style blocks' LayerNorm and GELU are single native kernels either way."""
    overlap_host_step: bool | None = None
    """Offloaded optimizer: each shard's host step (gradient down, CPU Adam) during the last backward, and the
    parameters' way back inside the next forward's gathers (``zero/overlapped_step.py``). None: where the
    strategy does it (FSDP2's engine, ``offload="cpu"``, Adam/AdamW; it waits for backward under clipping or
    a loss scale: pass False for such a run)."""


STRATEGY = Execution()


def matmul_peak(cluster: Cluster, precision: str) -> float:
    """The tensor-core peak a precision's matmuls run at: fp32 as TF32, half of bf16 on A100 through B200.
    (fp8 projections: ``Execution.float8_linears``.)"""
    if precision.startswith(("32", "64")):
        return cluster.peak_bf16_flops / 2
    return cluster.peak_bf16_flops


def group_bandwidth(cluster: Cluster, size: int, stride: int) -> float:
    """Bytes/s each member of a collective moves: ``size`` ranks ``stride`` apart, tensor ranks innermost.

    NVLink when the group fits in a node; across nodes NCCL runs one ring per NIC, so a group with
    ``k`` members in each node moves ``min(NVLink, k x NIC)``.
    """
    nvlink = cluster.intra_node_bandwidth * cluster.intra_node_efficiency
    if size * stride <= cluster.gpus_per_node:
        return nvlink
    per_node = max(1, cluster.gpus_per_node // stride)
    return min(nvlink, per_node * cluster.inter_node_bandwidth * cluster.inter_node_efficiency)


def all_reduce(nbytes: float, size: int, bandwidth: float) -> float:
    """Ring all-reduce: ``2 (d-1)/d`` of the buffer crosses each link."""
    return 2.0 * (size - 1) / size * nbytes / bandwidth if size > 1 else 0.0


def half_ring(nbytes: float, size: int, bandwidth: float) -> float:
    """Reduce-scatter, all-gather or all-to-all of a ``nbytes`` buffer: ``(d-1)/d`` of it crosses a link."""
    return (size - 1) / size * nbytes / bandwidth if size > 1 else 0.0


def all_to_all_time(nbytes: float, size: int, stride: int, cluster: Cluster) -> float:
    """All-to-all of a ``nbytes`` buffer over ``size`` ranks ``stride`` apart: each rank keeps ``1/size`` of it and
    sends each peer its share, NVLink to the peers in its node and its own NIC to the others, both at once.

    Unlike a ring (:func:`group_bandwidth`: one ring per NIC, so a node's NICs all carry it), every byte bound
    for another node crosses this GPU's own NIC: an expert dispatch over two H100 nodes sends half its bytes
    at 50 GB/s, not at the node's 400."""
    if size <= 1:
        return 0.0
    local = max(1, min(size, cluster.gpus_per_node // stride))  # the group's members in this rank's node
    nvlink = cluster.intra_node_bandwidth * cluster.intra_node_efficiency
    network = cluster.inter_node_bandwidth * cluster.inter_node_efficiency
    return max((local - 1) / size * nbytes / nvlink, (size - local) / size * nbytes / network)


@dataclass
class Stage:
    """The blocks a pipeline rank holds (all its chunks), and whether it holds the embedding or the head."""

    blocks: list[BlockShape] = field(default_factory=list)
    first: bool = False
    last: bool = False


def stages(shape: ModelShape, pipeline: int, virtual: int, schedule: str) -> list[Stage]:
    """Per pipeline rank: the strategy's cut (``pipeline/split.py: balanced_boundaries`` over the blocks'
    parameters) into ``P x V`` chunks, placed as the schedule places them."""
    spec = SCHEDULES[schedule]
    chunks = pipeline * virtual
    if chunks > 1:
        starts = balanced_boundaries([b.parameters for b in shape.blocks], chunks)
    else:
        starts = [0]
    ranks = [Stage() for _ in range(pipeline)]
    for chunk, blocks in enumerate(stage_ranges(starts, shape.num_layers)):
        rank = ranks[stage_owner(spec, chunk, pipeline) if pipeline > 1 else 0]
        rank.blocks += list(shape.blocks[blocks.start : blocks.stop])
        rank.first |= chunk == 0
        rank.last |= chunk == chunks - 1
    return ranks


def _gemm_elements(block: BlockShape, layout: Layout) -> float:
    """Elements one token's forward matmuls through ``block`` read and write in HBM, on one rank.

    Column-parallel matrices (q|k|v, MLP up) are cut along ``N``, row-parallel ones along ``K``;
    an expert's matmul sees ``tokens x top_k / experts`` rows of each of the ``ep`` ranks its dispatch gathers
    from (a rank holds ``experts / ep`` of them and reads each one's weights once).
    """
    tp, tokens = layout.tensor_parallel, layout.local_tokens
    h, ffn = block.hidden, block.ffn_hidden
    up = ffn * (2 if block.gated else 1)
    routed = max(block.top_k, 1) if block.num_experts else 1
    gathered = min(layout.expert_parallel, block.num_experts) if block.num_experts else 1
    expert_tokens = tokens * routed * gathered / max(block.num_experts, 1)
    dense = [(h, (block.q_width + 2 * block.kv_width) / tp, tokens), (block.q_width / tp, h, tokens)]
    mlp = [(h, up / tp, expert_tokens), (ffn / tp, h, expert_tokens)]
    total = sum(k + n + k * n / t for k, n, t in dense)
    return total + routed * sum(k + n + k * n / t for k, n, t in mlp)


def _alternate_recompute_flops(block: BlockShape) -> float:
    """FLOPs per token (whole width) of the projections ``"ops_alternate_matmuls"`` reruns in backward: every
    second one, except a last one whose output nothing in backward reads (torch's recomputation stops before)."""
    if block.num_experts:
        return 0.0  # routed experts are kept as under "ops" (planner/activations.py)
    h, q, kv, ffn = block.hidden, block.q_width, block.kv_width, block.ffn_hidden
    entries = [(h, q), (h, kv), (h, kv)] if block.attention_entries >= 3 else [(h, q + 2 * kv)]
    inner = (
        ([(h, ffn), (h, ffn)] if block.mlp_entries >= 2 else [(h, 2 * ffn)]) if block.gated else [(h, ffn)]
    )
    shapes = [*entries, (q, h), *inner, (ffn, h)]
    rerun = shapes[1::2] if len(shapes) % 2 == 1 else shapes[1:-1:2]
    return sum(2.0 * k * n for k, n in rerun)


def _cheap_elements(block: BlockShape, layout: Layout) -> float:
    """Elements one token's forward moves in the ops selective checkpointing reruns: norms, activation, softmax."""
    tp = layout.tensor_parallel
    residual = _RESIDUAL_PASSES * block.hidden / (tp if layout.sequence_parallel else 1)
    inner = (_MLP_PASSES + (1 if block.gated else 0)) * block.ffn_hidden / tp * max(block.top_k, 1)
    scores = _SCORE_PASSES * block.heads / tp * layout.sequence_length if layout.attention == "eager" else 0.0
    return residual + inner + scores  # fused attention keeps its scores on chip: counted as matmul FLOPs


def _eager_elements(block: BlockShape, layout: Layout) -> float:
    """Elements one token's forward moves beyond :func:`_cheap_elements` in eager PyTorch (Llama-style blocks)."""
    if not block.gated:
        return 0.0
    tp = layout.tensor_parallel
    norms = 2 * _EAGER_NORM_PASSES * block.hidden / (tp if layout.sequence_parallel else 1)
    rotary = _EAGER_ROTARY_PASSES * (block.q_width + block.kv_width) / tp
    return norms + rotary + _EAGER_MLP_PASSES * block.ffn_hidden / tp * max(block.top_k, 1)


def _other_elements(block: BlockShape, layout: Layout) -> float:
    """Elements fused attention's inputs and output and the MoE permutations move, per token (forward)."""
    attention = _ATTENTION_PASSES * (block.q_width + block.kv_width) / layout.tensor_parallel
    permute = _PERMUTE_PASSES * block.top_k * block.hidden if block.num_experts else 0.0
    return attention + permute


@dataclass
class MicroBatch:
    """One micro-batch on one rank, in seconds (and the FLOPs its recomputation adds)."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    tensor_parallel: float = 0.0
    expert: float = 0.0
    context: float = 0.0
    """Context parallelism's exchange of keys and values (ring) or of heads (Ulysses), exposed part."""
    transfers: float = 0.0
    recompute_flops: float = 0.0

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.recompute

    @property
    def total(self) -> float:
        return self.compute + self.tensor_parallel + self.expert + self.context + self.transfers


def _projection_inputs(block: BlockShape) -> float:
    """Elements of the inputs a token's projections read (what fp8 casts): q, k, v and the MLP's entries read
    the hidden state (once each under separate casts), the exits read the heads' and the MLP's outputs."""
    mlp_inputs = block.hidden * (2 if block.gated else 1) + block.ffn_hidden
    if block.num_experts:
        mlp_inputs *= block.top_k
    return 3 * block.hidden + block.q_width + mlp_inputs


def micro_batch(
    stage: Stage, shape: ModelShape, layout: Layout, cluster: Cluster, execution: Execution, virtual: int
) -> MicroBatch:
    """Time of one micro-batch on the rank holding ``stage`` (``virtual`` chunks of it under interleaving)."""
    tp, seq = layout.tensor_parallel, layout.sequence_length
    tokens = layout.local_tokens  # attention still spans the whole sequence: seq in the FLOPs per token
    compiled = layout.compile if execution.compiled is None else execution.compiled
    act = PRECISIONS[layout.precision][1]
    flop_rate = matmul_peak(cluster, layout.precision) * cluster.matmul_efficiency
    byte_rate = cluster.memory_bandwidth * cluster.memory_efficiency
    checkpointing = layout.activation_checkpointing

    flops = tokens * sum(b.forward_flops_per_token(seq) for b in stage.blocks) / tp
    cheap = (
        tokens
        * act
        * sum(
            _cheap_elements(b, layout) + (0.0 if compiled else _eager_elements(b, layout))
            for b in stage.blocks
        )
    )
    moved = cheap + tokens * act * sum(
        _gemm_elements(b, layout) + _other_elements(b, layout) for b in stage.blocks
    )
    if execution.float8_linears and cluster.peak_fp8_flops:
        # projections at the fp8 rate (as fewer 16-bit-rate FLOPs); each projection's input cast (read 16-bit,
        # write 8-bit: 1.5 x its 16-bit bytes) per pass, the weights' casts once per micro-batch
        projections = tokens * sum(2.0 * b.matmul_weights_per_token for b in stage.blocks) / tp
        flops -= projections * (1.0 - cluster.peak_bf16_flops / cluster.peak_fp8_flops)
        cast = execution.float8_cast_passes
        moved += cast * tokens * act * sum(_projection_inputs(b) for b in stage.blocks) / tp
        moved += cast * act * sum(b.matmul_weights_held(layout.expert_parallel) for b in stage.blocks) / tp
    head = head_moved = 0.0
    if stage.last:  # the output matmul (vocabulary cut over tensor ranks), the cross-entropy over its logits,
        # of this rank's tokens (under context parallelism too: context_parallel/local_tokens.py)
        vocab = shape.vocab_size / tp
        head = tokens * 2.0 * shape.head_weights / tp
        head_moved = tokens * (act * (shape.hidden + vocab) + _LOSS_BYTES_PER_LOGIT / 2 * vocab)
        head_moved += act * shape.head_weights / tp

    # fused attention keeps no probabilities: its backward computes the scores again (5 matmuls to the forward's 2)
    rescored = 0.0
    if layout.attention == "flash":
        rescored = 0.5 * tokens * sum(_attention_flops_per_token(b, seq) for b in stage.blocks) / tp
    out = MicroBatch()
    out.forward = (flops + head) / flop_rate + (moved + head_moved) / byte_rate
    out.backward = (2 * (flops + head) + rescored) / flop_rate + (2 * moved + head_moved) / byte_rate
    if checkpointing == "full":
        out.recompute_flops = flops
        out.recompute = flops / flop_rate + moved / byte_rate
    elif checkpointing == "selective":
        out.recompute = cheap / byte_rate
        if layout.activation_checkpointing_policy == "ops_alternate_matmuls":
            out.recompute_flops = tokens * sum(_alternate_recompute_flops(b) for b in stage.blocks) / tp
            out.recompute += out.recompute_flops / flop_rate
    matmul = (3 * (flops + head) + rescored + out.recompute_flops) / flop_rate

    # collectives per block: forward 2, backward 2; a recomputed forward 2 more; otherwise, under sequence
    # parallelism, the two entry inputs kept as slices gathered again in backward (one all-reduce's worth)
    passes = 4 + (2 if checkpointing == "full" else 1 if layout.sequence_parallel else 0)
    if tp > 1:
        activation = tokens * shape.hidden * act
        tensor = len(stage.blocks) * passes * all_reduce(activation, tp, group_bandwidth(cluster, tp, 1))
        out.tensor_parallel = max(0.0, tensor - matmul) if execution.overlap_tensor_parallel else tensor
    ep = layout.expert_parallel
    if ep > 1:
        routed = sum(tokens * b.top_k * b.hidden * act for b in stage.blocks if b.num_experts)
        out.expert = passes * all_to_all_time(routed, ep, tp, cluster)
    if layout.context_parallel > 1:
        attention = tokens * sum(_attention_flops_per_token(b, seq) for b in stage.blocks) / tp / flop_rate
        out.context = _context_exchange(stage, layout, cluster, tokens * act, attention)
        if stage.last:  # the all-gather of the per-token losses (fp32), before the step's reduction
            whole = layout.micro_batch_size * seq * 4.0
            out.context += half_ring(
                whole, layout.context_parallel, group_bandwidth(cluster, layout.context_parallel, tp)
            )
    if layout.pipeline_parallel > 1 and not execution.overlap_pipeline_transfers:
        split = layout.sequence_parallel or execution.split_pipeline_transfers
        sent = tokens * shape.hidden * act / (tp if split else 1)
        bandwidth = group_bandwidth(cluster, 2, tp * layout.data_parallel)
        out.transfers = 2 * virtual * sent / bandwidth  # activations forward, gradients backward, per chunk
    return out


def _attention_flops_per_token(block: BlockShape, sequence_length: int) -> float:
    """The attention core's forward FLOPs per token (scores and their product with the values): what is left of a
    block's FLOPs without its projections."""
    return block.forward_flops_per_token(sequence_length) - 2.0 * block.matmul_weights_per_token


def _context_exchange(
    stage: Stage, layout: Layout, cluster: Cluster, token_bytes: float, attention: float
) -> float:
    """Exposed time of context parallelism's exchanges for one micro-batch (``token_bytes``: this rank's tokens x
    bytes per element; ``attention``: its attention core's forward time). Ring: each block's keys and values
    travel around the ``cp`` ranks (``cp - 1`` hops) behind the attention of the chunk before, the first hop in
    the open; backward sends them again with their gradients (twice the bytes); full recomputation reruns the
    forward's. Ulysses: all-to-alls of q, k, v and the output over the ``cp`` ranks, in line."""
    cp, tp = layout.context_parallel, layout.tensor_parallel
    bandwidth = group_bandwidth(cluster, cp, tp)  # cp ranks next to the tensor ranks (mesh/parallel_dims.py)
    passes = 3 + (1 if layout.activation_checkpointing == "full" else 0)  # forward 1, backward 2, recompute 1
    if layout.context_parallel_mode == "ulysses":  # backward: one reverse all-to-all of the same bytes
        moved = sum(2 * (b.q_width + b.kv_width) for b in stage.blocks) / tp * token_bytes
        return (passes - 1) * all_to_all_time(moved, cp, tp, cluster)
    kv = sum(2 * b.kv_width for b in stage.blocks) / tp * token_bytes
    hops = (cp - 1) * kv / bandwidth  # one pass's exchange
    # forward: attention compute hides the hops; backward moves twice the bytes behind twice the compute
    forward = max(hops - attention, hops / cp)
    return (passes - 2) * forward + max(2 * hops - 2 * attention, 2 * hops / cp)
