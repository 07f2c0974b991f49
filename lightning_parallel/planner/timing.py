"""Time of one training step of a layout on a cluster, predicted from shapes and datasheets (no processes).

The step of the slowest rank, term by term (every rate from the :class:`~.cluster.Cluster`):

- per micro-batch (``planner/micro_batch.py``): compute (matmul FLOPs at ``peak x matmul_efficiency``
  plus HBM traffic at ``bandwidth x memory_efficiency``, recomputation included), tensor-parallel
  collectives (2 all-reduces of ``micro_batch x seq x hidden`` per block in forward, 2 in backward;
  sequence parallelism's all-gathers and reduce-scatters move the same bytes; NVLink when the group
  fits in a node; in line unless the run overlaps them), expert all-to-alls (dispatch and combine of
  ``top_k`` copies of each token, forward and backward) and pipeline sends;
- pipeline bubble: ``M x t_micro_batch x (1 / ideal_efficiency - 1)``, from
  :func:`~lightning_parallel.pipeline.schedules.ideal_efficiency` (1F1B, GPipe: ``M / (M + P - 1)``;
  interleaved: ``M / (M + (P - 1) / V)``; zero-bubble: 1), ``t_micro_batch`` the slowest rank's (the
  one with the head and loss);
- data parallelism, ring collectives over the rank's parameters: all-reduce ``2 (d-1)/d x bytes /
  bandwidth`` without ZeRO; reduce-scatter of gradients and all-gather of parameters at ZeRO-1/2;
  at ZeRO-3 also an all-gather in every micro-batch's forward and another in its backward (FSDP2
  re-gathers after ``reshard_after_forward``), prefetched behind that pass's compute but for the
  first unit. **Overlap assumed**: the gradient reduction runs during the last micro-batch's
  backward (DDP's buckets; the strategy's explicit buckets under pipelines, one stage at a time) and
  only what does not fit, at least the last bucket, is exposed; under interleaving only the chunk
  that finishes last (rank 0's first) has no backward left to hide behind. ZeRO-1/2's parameter
  all-gather after the update is exposed unless the run overlaps it with the next forward;
- optimizer: the update streams parameters, gradients and states through HBM; with ``offload``
  it runs on the host at ``host_adam_throughput`` after the gradients cross PCIe and before the
  parameters come back (ZeRO-3's host-held parameters also cross PCIe for every gather, prefetched
  a block ahead behind the pass's compute but for the first block; ``"nvme"`` also reads and writes
  the fp32 states on NVMe). Where the strategy overlaps the host step
  (``Execution.overlap_host_step``: FSDP2's CPU offload of Adam), the gradients' way down and the
  CPU Adam hide behind the last backward and the parameters' way up behind the next forward, all
  but one unit's share at least; with ``offload_update="delayed"`` the whole host step hides behind
  the next step's forward and backward, and only what exceeds them is exposed; with an importance split
  only the chosen rows' Adam waits, the other rows' sums and update hide behind the next step's passes
  (:func:`split_host_time`).

MFU counts model FLOPs (``3 x ModelShape.forward_flops_per_token``, no recomputation); the
hardware FLOP/s count recomputation as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_parallel.config.arguments import resolve_schedule
from lightning_parallel.pipeline.schedules import ideal_efficiency
from lightning_parallel.planner.cluster import Cluster
from lightning_parallel.planner.layout import PRECISIONS, Layout, gathered_parameter_bytes, zero_engine
from lightning_parallel.planner.micro_batch import (
    STRATEGY,
    Execution,
    Stage,
    all_reduce,
    group_bandwidth,
    half_ring,
    matmul_peak,
    micro_batch,
    stages,
)
from lightning_parallel.planner.shapes import ModelShape
from lightning_parallel.zero.arguments import ImportanceSplit

__all__ = ["STRATEGY", "Execution", "StepTime", "step_time"]

#: Bytes an optimizer step reads and writes per parameter on the device (fp32 master, gradient, states).
_OPTIMIZER_BYTES = {"adamw": 32.0, "adam": 32.0, "sgd": 20.0, "adafactor": 20.0}
_OFFLOADED_STATE_BYTES = 12.0  # fp32 master copy and two Adam moments, read and written on NVMe


@dataclass(frozen=True)
class StepTime:
    """One optimizer step, in seconds per term (exposed time: what overlaps is already left out)."""

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
    """The update on the device, or on the host with offload (its PCIe and NVMe transfers included)."""
    model_flops: float
    """FLOPs of the step by the model convention (3 x forward, no recomputation), all GPUs together."""
    hardware_flops: float
    """FLOPs the GPUs execute, recomputation included."""
    tokens: int
    gpus: int
    peak_flops: float
    """The per-GPU peak MFU is quoted against (the precision's)."""
    terms: dict[str, float] = field(default_factory=dict, compare=False)
    """Intermediate quantities (micro-batch time, pipeline efficiency, ...), for reading a prediction."""
    context_parallel: float = 0.0
    """Context parallelism's key/value (ring) or head (Ulysses) exchanges, exposed part."""

    @property
    def total(self) -> float:
        return sum(self.breakdown().values())

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
        """The terms that add up to the step time."""
        names = (
            "compute",
            "tensor_parallel",
            "context_parallel",
            "expert_all_to_all",
            "pipeline_bubble",
            "pipeline_transfers",
            "data_parallel",
            "optimizer",
        )
        return {name: getattr(self, name) for name in names}


def _parameters(stage: Stage, shape: ModelShape, layout: Layout) -> tuple[float, float]:
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


def step_time(
    shape: ModelShape, layout: Layout, cluster: Cluster, execution: Execution = STRATEGY
) -> StepTime:
    """Predicted time of one optimizer step of ``shape`` under ``layout`` on ``cluster`` (the module doc says how).

    Each data-parallel replica runs ``layout.micro_batches`` micro-batches of ``micro_batch_size``
    sequences per step: a pipeline's, or gradient accumulation's without pipeline stages.
    ``execution`` says what the training code overlaps (default: what the strategy does).
    """
    tp, pp, dp, ep = (
        layout.tensor_parallel,
        layout.pipeline_parallel,
        layout.data_parallel,
        layout.expert_parallel,
    )
    m = max(layout.micro_batches, 1)
    spec = resolve_schedule(layout.pipeline_schedule)  # a clear ValueError for an unknown name
    schedule = spec.name
    virtual = spec.fixed_virtual_stages or (layout.pipeline_virtual_stages if spec.multi_stage else 1)
    ranks = stages(shape, pp, virtual, schedule)
    micro = [micro_batch(s, shape, layout, cluster, execution, virtual) for s in ranks]
    slowest = max(range(pp), key=lambda r: micro[r].total)
    mb = micro[slowest]
    efficiency = ideal_efficiency(spec, m, pp, virtual) if pp > 1 else 1.0
    bubble = m * mb.total * (1.0 / efficiency - 1.0)

    param_bytes, _, grad_bytes = PRECISIONS[layout.precision]
    grad_bytes = execution.gradient_bytes or grad_bytes
    param_bytes = execution.parameter_bytes or param_bytes
    # 16-bit gathers cast on the device: the host copies of offloaded shards stay in the stored dtype
    gather_bytes = execution.parameter_bytes or gathered_parameter_bytes(layout) or param_bytes
    dense, experts = max((_parameters(s, shape, layout) for s in ranks), key=sum)
    groups = [(dense, dp, group_bandwidth(cluster, dp, tp))]  # (elements, ranks, bandwidth)
    if experts:  # an expert's replicas: the data-parallel ranks holding the same experts
        groups.append((experts, dp // ep, group_bandwidth(cluster, dp // ep, tp * ep)))
    zero = layout.zero_stage
    collective = half_ring if zero else all_reduce  # ZeRO reduce-scatters, plain replicas all-reduce
    reduce_grads = sum(collective(n * grad_bytes, d, bw) for n, d, bw in groups)
    gather = sum(half_ring(n * gather_bytes, d, bw) for n, d, bw in groups) if zero else 0.0
    # Each of a rank's chunks reduces once its own last backward is done: all but the chunk that
    # finishes last (rank 0's first) reduce behind the backward the cool-down still holds.
    chunks = virtual if pp > 1 else 1
    window = (micro[0].backward + micro[0].recompute) / chunks
    # ZeRO-3 gathers each unit again in backward: the last micro-batch's backward hides those gathers and
    # the gradient reduction together, in one window (the others' backward hides only their gathers).
    last_backward_gather = gather if zero == 3 and execution.overlap_gradient_reduction else 0.0
    if execution.overlap_gradient_reduction:
        gradient_bytes = sum(n for n, _, _ in groups) * grad_bytes
        last_bucket = reduce_grads * min(1.0, execution.bucket_bytes / max(gradient_bytes, 1.0))
        reduce_grads = max(reduce_grads / chunks + last_backward_gather - window, last_bucket)
    if zero == 3:  # gathered again in every micro-batch's forward and backward, prefetched behind compute
        first_unit = gather / max(len(ranks[0].blocks), 1)
        hidden_alone = m - 1 if last_backward_gather else m  # backward windows holding only gathers
        gather = m * (max(0.0, gather - mb.forward) + 2 * first_unit) + hidden_alone * max(
            0.0, gather - mb.backward
        )
    elif zero and execution.overlap_parameter_gather:  # the later chunks' gathers hide in the warm-up
        gather = max(0.0, (gather - micro[0].forward) / chunks)

    updated = sum(n / (d if zero else 1) for n, d, _ in groups)  # elements this rank's optimizer updates
    if layout.offload in ("cpu", "nvme"):
        pcie = cluster.host_bandwidth * cluster.host_efficiency
        units = max(len(ranks[0].blocks), 1)  # what overlaps leaves exposed at least: one unit's share
        down = updated * grad_bytes / pcie  # the gradients down
        adam = updated / cluster.host_adam_throughput  # CPU Adam
        host = down + adam
        back = updated * param_bytes / pcie  # the updated parameters up
        passes = m * (mb.forward + mb.backward + mb.recompute)
        if layout.offload_update == "delayed":  # the whole host step behind the next step's passes
            host, back = max(0.0, host + back - passes), 0.0
        elif isinstance(layout.offload_update, ImportanceSplit):
            # the gradients' way down as for the exact step
            host = max(down - window, down / units) + split_host_time(layout.offload_update, adam, passes)
            back = max(back - mb.forward, back / units)
        elif _overlaps_host_step(layout, execution):  # behind the last backward; back inside the next forward
            host = max(host - window, host / units)
            back = max(back - mb.forward, back / units)
        optimizer = host + back
        if zero == 3:  # the parameters live on the host: copied up for each gather, a block ahead of its use
            up = updated * param_bytes / pcie
            optimizer += m * (max(0.0, up - mb.forward) + max(0.0, up - mb.backward) + 2 * up / units)
        if layout.offload == "nvme":
            optimizer += 2 * updated * _OFFLOADED_STATE_BYTES / cluster.nvme_bandwidth
    else:
        per_parameter = _OPTIMIZER_BYTES.get(layout.optimizer, _OPTIMIZER_BYTES["adamw"])
        optimizer = updated * per_parameter / (cluster.memory_bandwidth * cluster.memory_efficiency)

    seq = layout.sequence_length
    tokens = layout.global_batch * seq
    model_flops = 3.0 * shape.forward_flops_per_token(seq) * tokens
    full = layout.activation_checkpointing == "full"
    recomputed = sum(b.forward_flops_per_token(seq) for b in shape.blocks) * tokens if full else 0.0
    return StepTime(
        compute=m * mb.compute,
        recomputation=m * mb.recompute,
        tensor_parallel=m * mb.tensor_parallel,
        expert_all_to_all=m * mb.expert,
        context_parallel=m * mb.context,
        pipeline_bubble=bubble,
        pipeline_transfers=m * mb.transfers,
        data_parallel=reduce_grads + gather,
        optimizer=optimizer,
        model_flops=model_flops,
        hardware_flops=model_flops + recomputed,
        tokens=tokens,
        gpus=layout.gpus,
        peak_flops=matmul_peak(cluster, layout.precision),
        terms={
            "micro_batch": mb.total,
            "pipeline_efficiency": efficiency,
            "slowest_rank": float(slowest),
            "gradient_window": window,
        },
    )


_SUM_SHARE = 3 / 7
"""A gradient summed on the host against Adam's update, in memory traffic: the sum reads the gradient and reads and
writes the sum (3 tensors' worth); Adam reads the parameter, gradient and two moments and writes three (7)."""


def split_host_time(rule: ImportanceSplit, adam: float, passes: float) -> float:
    """Exposed host time per step of an importance split (``zero/importance_split.py``), ``adam`` the whole host Adam's
    time and ``passes`` one step's forward and backward: the chosen rows' Adam on the step's path; the worker's sums
    every step and the others' update every ``update_interval``-th behind the next step's passes, the excess exposed."""
    others = (1.0 - rule.top_rows) * adam
    sums = others * _SUM_SHARE
    plain, flushing = max(0.0, sums - passes), max(0.0, sums + others - passes)
    n = rule.update_interval
    return rule.top_rows * adam + ((n - 1) * plain + flushing) / n


def _overlaps_host_step(layout: Layout, execution: Execution) -> bool:
    """Whether the host step runs during backward: ``execution``'s say, else where the strategy does it."""
    if execution.overlap_host_step is not None:
        return execution.overlap_host_step

    return (
        layout.offload == "cpu" and layout.optimizer in ("adam", "adamw") and zero_engine(layout) == "fsdp2"
    )
