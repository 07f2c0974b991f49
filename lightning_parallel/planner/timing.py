"""Time of one training step of a layout on a cluster, predicted from shapes and datasheets (no processes).

The step of the slowest pipeline rank, term by term (every rate from the :class:`Cluster`):

- compute, per micro-batch: matmul FLOPs on the rank (forward, backward = 2 x forward, plus
  recomputation: ``"full"`` one more forward of the blocks, ``"selective"`` one more attention core)
  at ``peak x matmul_efficiency``, plus the memory-bound kernels (norms, bias-dropout-residual,
  the MLP activation, the loss over the vocabulary, eager attention's softmax and dropout over the
  score matrix) at ``HBM bandwidth x memory_efficiency``. The second term is why small widths
  reach a lower MFU: matmul FLOPs grow with ``hidden^2`` per token, this traffic with ``hidden``.
  Without sequence parallelism the residual-width kernels are repeated on every tensor rank.
- tensor parallelism: per block 2 all-reduces of ``micro_batch x seq x hidden`` activations in
  forward and 2 in backward (2 more when full recomputation reruns the forward); sequence
  parallelism's all-gather + reduce-scatter move the same bytes. NVLink when the group fits in a
  node, else the network. Not overlapped (the strategy runs them in line), unless ``execution``
  says so (Megatron's ``--tp-comm-overlap``).
- experts: dispatch and combine all-to-alls of ``top_k`` copies of every token, forward and backward.
- pipeline: per micro-batch activation sends forward and gradient sends backward (in line), and the
  bubble of the schedule, ``M x t_micro_batch x (1 / ideal_efficiency - 1)`` with
  :func:`~lightning_parallel.pipeline.schedules.ideal_efficiency`; ``t_micro_batch`` is the slowest
  rank's, which holds the output head and loss.
- data parallelism: ring collectives, ``2 (d-1)/d x bytes / bandwidth`` for an all-reduce (ZeRO 0),
  reduce-scatter of gradients + all-gather of parameters (ZeRO 1/2), and at ZeRO 3 an all-gather of
  the parameters in every micro-batch's forward and again in its backward (FSDP2 re-gathers after
  ``reshard_after_forward``), hidden behind that pass's compute except the first unit's. The gradient
  reduction is assumed to overlap the last micro-batch's backward except its last bucket (DDP's
  buckets, the strategy's explicit buckets under pipelines); ZeRO-1/2's parameter all-gather after
  the step is exposed.
- optimizer: the update streams its states through HBM on the device, or with ``offload="cpu"``
  runs on the host at ``host_adam_throughput`` after the gradients cross PCIe (and the parameters
  come back), not overlapped with backward; ``"nvme"`` also reads and writes the states on NVMe.

A group's bandwidth: NVLink when it fits in a node, else ``min(NVLink, k x NIC)`` for the ``k``
members a node holds (NCCL runs one ring per NIC). Ranks are laid out as the strategy's mesh
(pp, dp, tp), tensor ranks innermost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_parallel.pipeline.schedules import ALIASES, SCHEDULES, ideal_efficiency, stage_owner
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.layout import PRECISIONS, Layout
from lightning_parallel.planner.shapes import BlockShape, ModelShape

__all__ = ["STRATEGY", "Execution", "StepTime", "step_time"]

# Memory-bound traffic, in activation elements each kernel reads or writes (forward; backward 2x):
_RESIDUAL_PASSES = (
    11.0  # 2 norms (read, write) + 2 fused bias-dropout-residual adds (2 reads, 1 write, 1-byte mask)
)
_MLP_PASSES = 2.0  # activation function: read and write the inner width (gated: 3, two inputs)
_ATTENTION_PASSES = 2.0  # fused attention: read q, k, v and write the output (q and k/v widths)
_SCORE_PASSES = 4.5  # eager attention: softmax (read, write) + dropout (read, write, mask) per score
_PERMUTE_PASSES = 4.0  # MoE: token permutation and its inverse (read, write) per routed copy
_LOSS_BYTES_PER_LOGIT = (
    68.0  # unfused cross-entropy in fp32 (Megatron's vocab-parallel one): ~17 passes of 4 bytes
)
#: Bytes an optimizer step reads and writes per parameter on the device (fp32 master, gradient, states).
_OPTIMIZER_BYTES = {"adamw": 32.0, "adam": 32.0, "sgd": 20.0, "adafactor": 20.0}
_OFFLOADED_STATE_BYTES = 12.0  # fp32 master copy + two Adam moments, read and written on NVMe


@dataclass(frozen=True)
class Execution:
    """How the training code runs a layout beyond its degrees: what it overlaps and what its collectives carry.

    :data:`STRATEGY` is what ``HybridParallelStrategy`` does; the published runs
    (``planner/published.py``) pass what their sources say their code did.
    """

    overlap_tensor_parallel: bool = False
    """Tensor-parallel collectives hidden behind the matmuls (Megatron ``--tp-comm-overlap``)."""
    overlap_gradient_reduction: bool = True
    """Data-parallel gradient reduction during the last backward, all but the last bucket hidden."""
    overlap_parameter_gather: bool = False
    """ZeRO-1/2's parameter all-gather hidden behind the next forward (Megatron ``--overlap-param-gather``)."""
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


STRATEGY = Execution()


@dataclass(frozen=True)
class StepTime:
    """One optimizer step, in seconds per term (exposed time: what overlaps is already removed)."""

    compute: float
    """Matmuls and memory-bound kernels of all micro-batches on the slowest rank, recomputation included."""
    recomputation: float
    """The part of ``compute`` that activation checkpointing reruns."""
    tensor_parallel: float
    expert_all_to_all: float
    pipeline_bubble: float
    pipeline_transfers: float
    data_parallel: float
    """Gradient reduction and ZeRO's parameter gathers, exposed part."""
    optimizer: float
    """The update on the device, or on the host with offload (its PCIe/NVMe transfers included)."""
    model_flops: float
    """FLOPs of the step by the model convention (3 x forward, no recomputation), all GPUs together."""
    hardware_flops: float
    """FLOPs the GPUs execute, recomputation included."""
    tokens: int
    gpus: int
    peak_flops: float
    terms: dict[str, float] = field(default_factory=dict, compare=False)
    """Intermediate quantities (per micro-batch times, bandwidths), for reading a prediction."""

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.tensor_parallel
            + self.expert_all_to_all
            + self.pipeline_bubble
            + self.pipeline_transfers
            + self.data_parallel
            + self.optimizer
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs / (step time x GPUs x peak)."""
        return self.model_flops / (self.total * self.gpus * self.peak_flops)

    @property
    def model_flops_per_gpu(self) -> float:
        """Model FLOP/s per GPU."""
        return self.model_flops / (self.total * self.gpus)

    @property
    def hardware_flops_per_gpu(self) -> float:
        """FLOP/s per GPU counting recomputation (what PTD-P reports)."""
        return self.hardware_flops / (self.total * self.gpus)

    def breakdown(self) -> dict[str, float]:
        names = ("compute", "tensor_parallel", "expert_all_to_all", "pipeline_bubble", "pipeline_transfers",
                 "data_parallel", "optimizer")  # fmt: skip
        return {name: getattr(self, name) for name in names}


# ---- hardware ------------------------------------------------------------------------------------


def _peak(cluster: Cluster, precision: str) -> float:
    """The tensor-core peak the precision's matmuls run at: fp32 as TF32 (half of bf16 on A100 through B200)."""
    if "8" in precision.split("-")[0] or "transformer-engine" in precision:
        return cluster.peak_fp8_flops or cluster.peak_bf16_flops
    if precision.startswith("32") or precision.startswith("64"):
        return cluster.peak_bf16_flops / 2
    return cluster.peak_bf16_flops


def group_bandwidth(cluster: Cluster, size: int, stride: int) -> float:
    """Bytes/s one member of a collective moves, ``size`` ranks ``stride`` apart (NCCL rings, one per NIC)."""
    nvlink = cluster.intra_node_bandwidth * cluster.intra_node_efficiency
    if size * stride <= cluster.gpus_per_node:
        return nvlink
    per_node = max(1, cluster.gpus_per_node // stride)
    return min(nvlink, per_node * cluster.inter_node_bandwidth * cluster.inter_node_efficiency)


def _all_reduce(nbytes: float, size: int, bandwidth: float) -> float:
    return 2.0 * (size - 1) / size * nbytes / bandwidth if size > 1 else 0.0


def _half_ring(nbytes: float, size: int, bandwidth: float) -> float:
    """Reduce-scatter, all-gather or all-to-all of a ``nbytes`` buffer: ``(d-1)/d`` of it crosses a link."""
    return (size - 1) / size * nbytes / bandwidth if size > 1 else 0.0


# ---- one rank's share of the model -------------------------------------------------------------


@dataclass
class _Stage:
    blocks: list[BlockShape] = field(default_factory=list)
    first: bool = False
    last: bool = False


def _stages(shape: ModelShape, pipeline: int, virtual: int, schedule: str) -> list[_Stage]:
    """The blocks each pipeline rank holds: ``P x V`` even chunks, placed as the schedule places them."""
    spec = SCHEDULES[schedule]
    chunks = pipeline * virtual
    layers = shape.num_layers
    sizes = [layers // chunks + (1 if c < layers % chunks else 0) for c in range(chunks)]
    ranks = [_Stage() for _ in range(pipeline)]
    start = 0
    for chunk, size in enumerate(sizes):
        rank = ranks[stage_owner(spec, chunk, pipeline) if pipeline > 1 else 0]
        rank.blocks += list(shape.blocks[start : start + size])
        rank.first |= chunk == 0
        rank.last |= chunk == chunks - 1
        start += size
    return ranks


def _gemm_elements(block: BlockShape, layout: Layout) -> float:
    """Elements one token's forward matmuls through ``block`` read and write in HBM, on one rank.

    A ``K x N`` matmul over ``T`` tokens reads ``T K`` inputs and ``K N`` weights and writes ``T N``
    outputs: per token ``K + N + K N / T``. Its bytes per FLOP, ``(1/K + 1/N + 1/T) / 2``, are why thin
    matmuls (small width per tensor rank, few tokens per micro-batch) run further from the peak.
    Column-parallel matrices (q|k|v, MLP up) are cut along ``N``, row-parallel ones along ``K``.
    """
    tp, tokens = layout.tensor_parallel, layout.micro_batch_size * layout.sequence_length
    h, ffn = block.hidden, block.ffn_hidden
    up = ffn * (2 if block.gated else 1)
    routed = max(block.top_k, 1) if block.num_experts else 1
    expert_tokens = tokens * routed / max(block.num_experts, 1)  # rows each expert's matmul sees
    dense = [(h, (block.q_width + 2 * block.kv_width) / tp, tokens), (block.q_width / tp, h, tokens)]
    mlp = [(h, up / tp, expert_tokens), (ffn / tp, h, expert_tokens)]
    total = sum(k + n + k * n / t for k, n, t in dense)
    return total + routed * sum(k + n + k * n / t for k, n, t in mlp)


def _elementwise_elements(block: BlockShape, layout: Layout) -> float:
    """Elements one token's forward through ``block`` moves in memory-bound kernels, on one rank."""
    tp = layout.tensor_parallel
    residual = _RESIDUAL_PASSES * block.hidden / (tp if layout.sequence_parallel else 1)
    attention = _ATTENTION_PASSES * (block.q_width + block.kv_width) / tp
    inner = (_MLP_PASSES + (1 if block.gated else 0)) * block.ffn_hidden / tp * max(block.top_k, 1)
    permute = _PERMUTE_PASSES * block.top_k * block.hidden if block.num_experts else 0.0
    return residual + attention + inner + permute + _score_elements(block, layout)


def _score_elements(block: BlockShape, layout: Layout) -> float:
    if layout.attention != "eager":
        return 0.0  # fused attention keeps the scores on chip; its FLOPs are counted as matmuls
    return _SCORE_PASSES * block.heads / layout.tensor_parallel * layout.sequence_length


@dataclass
class _MicroBatch:
    """One micro-batch on one rank: times in seconds."""

    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    matmul: float = 0.0
    tensor_parallel: float = 0.0
    expert: float = 0.0
    transfers: float = 0.0
    recompute_flops: float = 0.0

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.recompute

    @property
    def total(self) -> float:
        return self.compute + self.tensor_parallel + self.expert + self.transfers


def _micro_batch(stage: _Stage, shape: ModelShape, layout: Layout, cluster: Cluster, execution: Execution,
                 virtual: int) -> _MicroBatch:  # fmt: skip
    tp, seq = layout.tensor_parallel, layout.sequence_length
    tokens = layout.micro_batch_size * seq
    act = PRECISIONS[layout.precision][1]
    flop_rate = _peak(cluster, layout.precision) * cluster.matmul_efficiency
    byte_rate = cluster.memory_bandwidth * cluster.memory_efficiency
    checkpointing = layout.activation_checkpointing

    flops = tokens * sum(b.forward_flops_per_token(seq) for b in stage.blocks) / tp
    core = tokens * sum(4.0 * seq * b.q_width for b in stage.blocks) / tp  # scores and weighted sum
    moved = (
        tokens * act * sum(_gemm_elements(b, layout) + _elementwise_elements(b, layout) for b in stage.blocks)
    )
    scores = tokens * act * sum(_score_elements(b, layout) for b in stage.blocks)
    head = head_moved = 0.0
    if stage.last:  # output matmul (vocabulary cut over tensor ranks) and the cross-entropy over its logits
        head = tokens * 2.0 * shape.head_weights / tp
        vocab = shape.vocab_size / tp
        head_moved = tokens * (act * (shape.hidden + vocab) + _LOSS_BYTES_PER_LOGIT / 2 * vocab)
        head_moved += act * shape.head_weights / tp

    out = _MicroBatch()
    out.forward = (flops + head) / flop_rate + (moved + head_moved) / byte_rate
    out.backward = 2 * (flops + head) / flop_rate + (2 * moved + head_moved) / byte_rate
    if checkpointing == "full":
        out.recompute_flops = flops
        out.recompute = flops / flop_rate + moved / byte_rate
    elif checkpointing == "selective":
        out.recompute_flops = core
        out.recompute = core / flop_rate + scores / byte_rate
    out.matmul = (3 * (flops + head) + out.recompute_flops) / flop_rate

    layers = len(stage.blocks)
    passes = 4 + (2 if checkpointing == "full" else 0)  # collectives per block: forward 2, backward 2
    if tp > 1:
        activation = tokens * shape.hidden * act
        tensor = layers * passes * _all_reduce(activation, tp, group_bandwidth(cluster, tp, 1))
        out.tensor_parallel = max(0.0, tensor - out.matmul) if execution.overlap_tensor_parallel else tensor
    ep = layout.expert_parallel
    if ep > 1:
        bandwidth = group_bandwidth(cluster, ep, tp)
        routed = sum(tokens * b.top_k * b.hidden * act for b in stage.blocks if b.num_experts)
        out.expert = passes * _half_ring(routed, ep, bandwidth)
    if layout.pipeline_parallel > 1 and not execution.overlap_pipeline_transfers:
        split = layout.sequence_parallel or execution.split_pipeline_transfers
        sent = tokens * shape.hidden * act / (tp if split else 1)
        bandwidth = group_bandwidth(cluster, 2, tp * layout.data_parallel)
        out.transfers = 2 * virtual * sent / bandwidth  # activations forward, gradients backward, per chunk
    return out


def _parameters(stage: _Stage, shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameter elements the rank holds after tensor and expert sharding."""
    tp, ep = layout.tensor_parallel, layout.expert_parallel
    experts = sum(b.expert_parameters for b in stage.blocks)
    dense = sum(b.parameters for b in stage.blocks) - experts
    if stage.first:
        dense += shape.pre_parameters
    if stage.last:
        dense += shape.post_parameters
        if shape.tied_head and not stage.first:
            dense += shape.head_weights  # the tied head's copy on the last stage
    return dense / tp, experts / (tp * ep)


# ---- the step ------------------------------------------------------------------------------------


def step_time(
    shape: ModelShape, layout: Layout, cluster: Cluster, execution: Execution = STRATEGY
) -> StepTime:
    """Predicted time of one optimizer step of ``shape`` under ``layout`` on ``cluster`` (see the module doc).

    ``layout.micro_batches`` micro-batches of ``micro_batch_size`` sequences per data-parallel
    replica and step: a pipeline's, or gradient accumulation's without pipeline stages.
    """
    tp, pp, dp, ep = (
        layout.tensor_parallel,
        layout.pipeline_parallel,
        layout.data_parallel,
        layout.expert_parallel,
    )
    m = max(layout.micro_batches, 1)
    schedule = ALIASES.get(layout.pipeline_schedule.lower(), layout.pipeline_schedule.lower())
    if schedule not in SCHEDULES:
        raise ValueError(
            f"Unknown pipeline schedule {layout.pipeline_schedule!r}: one of {sorted(SCHEDULES)}."
        )
    if layout.precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {layout.precision!r}: one of {sorted(PRECISIONS)}.")
    spec = SCHEDULES[schedule]
    virtual = spec.fixed_virtual_stages or (layout.pipeline_virtual_stages if spec.multi_stage else 1)
    stages = _stages(shape, pp, virtual, schedule)
    micro = [_micro_batch(s, shape, layout, cluster, execution, virtual) for s in stages]
    slowest = max(range(pp), key=lambda r: micro[r].total)
    mb = micro[slowest]
    efficiency = ideal_efficiency(spec, m, pp, virtual) if pp > 1 else 1.0
    bubble = m * mb.total * (1.0 / efficiency - 1.0)

    param_bytes, _, grad_bytes, _ = PRECISIONS[layout.precision]
    grad_bytes = execution.gradient_bytes or grad_bytes
    param_bytes = execution.parameter_bytes or param_bytes
    held = [_parameters(s, shape, layout) for s in stages]
    dense, experts = max(held, key=sum)
    groups = [(dense, dp, group_bandwidth(cluster, dp, tp))]
    if experts:
        groups.append((experts, dp // ep, group_bandwidth(cluster, dp // ep, tp * ep)))
    zero = layout.zero_stage
    collective = _half_ring if zero else _all_reduce  # ZeRO reduce-scatters, plain replicas all-reduce
    reduce_grads = sum(collective(n * grad_bytes, d, bw) for n, d, bw in groups)
    gather = sum(_half_ring(n * param_bytes, d, bw) for n, d, bw in groups) if zero else 0.0
    # Each of a rank's V chunks reduces once its own last backward is done: all but the chunk that
    # finishes last (rank 0's first) reduce behind the backward work the cool-down still holds.
    chunks = virtual if pp > 1 else 1
    backward_window = (micro[0].backward + micro[0].recompute) / chunks
    if execution.overlap_gradient_reduction:
        grad_bytes_total = sum(n for n, _, _ in groups) * grad_bytes
        last_bucket = reduce_grads * min(1.0, execution.bucket_bytes / max(grad_bytes_total, 1.0))
        reduce_grads = max(reduce_grads / chunks - backward_window, last_bucket)
    if zero == 3:  # gathered again in every micro-batch's forward and backward, prefetched behind compute
        first_unit = gather / max(len(stages[0].blocks), 1)
        gather = m * (max(0.0, gather - mb.forward) + max(0.0, gather - mb.backward) + 2 * first_unit)
    elif zero and execution.overlap_parameter_gather:
        gather = max(0.0, (gather - micro[0].forward) / chunks)  # the later chunks' behind the warm-up
    data_parallel = reduce_grads + gather

    updated = sum(n / (d if zero else 1) for n, d, _ in groups)  # elements this rank's optimizer updates
    if layout.offload in ("cpu", "nvme"):
        pcie = cluster.host_bandwidth * cluster.host_efficiency
        optimizer = updated / cluster.host_adam_throughput + updated * (grad_bytes + param_bytes) / pcie
        if zero == 3:  # the parameters live on the host: copied up for each gather
            optimizer += m * 2 * updated * param_bytes / pcie
        if layout.offload == "nvme":
            optimizer += 2 * updated * _OFFLOADED_STATE_BYTES / cluster.nvme_bandwidth
    else:
        per_param = _OPTIMIZER_BYTES.get(layout.optimizer, _OPTIMIZER_BYTES["adamw"])
        optimizer = updated * per_param / (cluster.memory_bandwidth * cluster.memory_efficiency)

    tokens = layout.global_batch * layout.sequence_length
    model_flops = 3.0 * shape.forward_flops_per_token(layout.sequence_length) * tokens
    seq = layout.sequence_length
    if layout.activation_checkpointing == "full":
        recompute_per_token = sum(b.forward_flops_per_token(seq) for b in shape.blocks)
    elif layout.activation_checkpointing == "selective":
        recompute_per_token = sum(4.0 * seq * b.q_width for b in shape.blocks)
    else:
        recompute_per_token = 0.0
    return StepTime(
        compute=m * mb.compute,
        recomputation=m * mb.recompute,
        tensor_parallel=m * mb.tensor_parallel,
        expert_all_to_all=m * mb.expert,
        pipeline_bubble=bubble,
        pipeline_transfers=m * mb.transfers,
        data_parallel=data_parallel,
        optimizer=optimizer,
        model_flops=model_flops,
        hardware_flops=model_flops + recompute_per_token * tokens,
        tokens=tokens,
        gpus=layout.gpus,
        peak_flops=_peak(cluster, layout.precision),
        terms={
            "micro_batch": mb.total,
            "pipeline_efficiency": efficiency,
            "slowest_rank": float(slowest),
            "gradient_reduction_window": backward_window,
        },
    )
