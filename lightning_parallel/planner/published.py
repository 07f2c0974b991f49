"""The time model against published runs: two tables of TFLOP/s per GPU, predicted with one efficiency per chip.

The tables are those of ANCHORS.md in the project's shared reference (not shipped; each row's source is below);
what the tables leave out (micro-batch size, schedule, recomputation, what overlaps) is taken from what each
source says its runs did:

**PTD-P** (Narayanan et al., SC21, Table 1; Selene, DGX A100 80 GB, 8 GPUs and 8 HDR NICs a node).
The paper's own launch script, ``examples/academic_paper_scripts/sc21/run_table_1.sh`` in
NVIDIA/Megatron-LM, gives each row's micro-batch size (16, 16, 8, 4, 2, 1, 1), full recomputation of
every layer (``--activations-checkpoint-method uniform``), the interleaved schedule for 145B (5
layers a virtual stage: V = 2) and 530B (1 layer: V = 3) and plain 1F1B for 39B and 1T, fp16 with a
loss scale (gradients all-reduced in fp16), and the data-parallel implementation: torch DDP
(gradient all-reduce overlapping backward) up to 18B, Megatron's "local" DDP (all-reduce after
backward, not overlapped) from 39B. No sequence parallelism and no overlap of tensor-parallel
collectives existed yet; attention is unfused (softmax and dropout over the score matrix in HBM).
The paper counts FLOPs with recomputation, ``96 B s L h^2 (1 + s/6h + V/16Lh)``, and so do the
predictions for this table. GPT with the embedding tied to the head, vocabulary 51,200, sequence 2,048.

**Megatron-LM README, H100** (Megatron-Core r0.8.0, July 2024: the README's model table and scaling
figures, commit f2e5db402c). The README says the runs overlap data-parallel
(``--overlap-grad-reduce --overlap-param-gather``: the distributed optimizer, i.e. ZeRO-1, gradients
reduced in fp32 as Megatron does for bf16, parameters gathered in bf16), tensor-parallel
(``--tp-comm-overlap``, which needs sequence parallelism) and pipeline communication. It states no
micro-batch size, schedule or recomputation; assumed here, one rule for the whole table:

- no recomputation (flash attention; every row fits in 80 GB without it);
- with a pipeline, micro-batches of one sequence (Megatron's default), ``batch / dp`` of them, and
  the interleaved schedule with 4 virtual stages a rank: with it the model reproduces the README's
  strong-scaling figure of the 177B row (47% MFU on 96 GPUs with 576 micro-batches, 44% on 2,304
  GPUs with 24: a ratio of 0.936; the model gives 0.94 with V = 4, 0.88 with V = 2, 0.79 with
  1F1B). Megatron needs equal chunks, which 4 does not cut for 70B (42 layers a stage), 119B (23)
  and 462B (7): the model splits those as evenly as it can;
- without a pipeline, the replica's 4 sequences as one micro-batch: with 4 micro-batches of one,
  the 32B row's fp32 reduce-scatter (15.8 GB a GPU over one 400 Gb/s NIC, ~0.37 s) has only the
  last micro-batch's backward (~0.1 s) to hide behind, and the model falls 22% short of the row.

The embedding and head are untied (the stated sizes count both). FLOPs as Megatron counted them then
(``num_floating_point_operations`` of July 2024): ``12 B s L h^2 (6 + s/h + V/2Lh)``, 3 x the
forward, causal attention counted in full, no recomputation: the model convention of
``ModelShape.forward_flops_per_token``.

``python -m lightning_parallel.planner.published`` prints both tables (docs/planner.md holds its output).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_parallel.planner.cluster import CLUSTERS, Cluster
from lightning_parallel.planner.layout import Layout
from lightning_parallel.planner.shapes import ModelShape
from lightning_parallel.planner.timing import Execution, StepTime, step_time

__all__ = [
    "MEGATRON_H100",
    "PTD_P",
    "Comparison",
    "PublishedRun",
    "compare",
    "markdown",
    "published_flops",
    "summary",
]


@dataclass(frozen=True)
class PublishedRun:
    """One row of a published table, with what its source says about how it ran."""

    source: str
    name: str
    heads: int
    hidden: int
    layers: int
    tensor: int
    pipeline: int
    gpus: int
    batch: int
    tflops: float
    """Published TFLOP/s per GPU."""
    micro_batch_size: int = 1
    virtual_stages: int = 1
    overlapped_gradients: bool = True

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)


_PTD_P = "PTD-P Table 1"
_MEGATRON = "Megatron-LM README, H100"
PTD_P: tuple[PublishedRun, ...] = (
    PublishedRun(_PTD_P, "1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    PublishedRun(_PTD_P, "7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16),
    PublishedRun(_PTD_P, "18B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    PublishedRun(_PTD_P, "39B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, overlapped_gradients=False),
    PublishedRun(_PTD_P, "145B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2, overlapped_gradients=False),
    PublishedRun(_PTD_P, "530B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3, overlapped_gradients=False),
    PublishedRun(_PTD_P, "1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, overlapped_gradients=False),
)
MEGATRON_H100: tuple[PublishedRun, ...] = tuple(
    PublishedRun(
        _MEGATRON,
        name,
        a,
        h,
        layers,
        t,
        p,
        t * p * d,
        batch,
        tflops,
        1 if p > 1 else batch // d,
        4 if p > 1 else 1,
    )
    for name, a, h, layers, t, p, d, batch, tflops in (
        ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
        ("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1),
        ("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7),
        ("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
        ("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9),
    )
)


def _setup(run: PublishedRun) -> tuple[ModelShape, Layout, Cluster, Execution]:
    """The shape, layout, cluster and execution a published row describes (module docstring: sources)."""
    ptd_p = run.source == _PTD_P
    sequence, vocab = (2048, 51_200) if ptd_p else (4096, 131_072)
    shape = ModelShape.gpt(
        run.layers,
        run.hidden,
        run.heads,
        vocab,
        sequence_length=sequence,
        tied_head=ptd_p,
        name=f"GPT-{run.name}",
    )
    per_replica = run.batch // run.data
    layout = Layout(
        tensor_parallel=run.tensor,
        sequence_parallel=not ptd_p and run.tensor > 1,
        pipeline_parallel=run.pipeline,
        pipeline_schedule="interleaved_1f1b" if run.virtual_stages > 1 else "1f1b",
        pipeline_virtual_stages=run.virtual_stages,
        micro_batches=per_replica // run.micro_batch_size,
        data_parallel=run.data,
        zero_stage=0 if ptd_p else 1,
        activation_checkpointing="full" if ptd_p else None,
        precision="16-mixed" if ptd_p else "bf16-mixed",
        micro_batch_size=run.micro_batch_size,
        sequence_length=sequence,
        attention="eager" if ptd_p else "flash",
    )
    if ptd_p:
        execution = Execution(
            overlap_gradient_reduction=run.overlapped_gradients,
            split_pipeline_transfers=True,
            gradient_bytes=2,
            parameter_bytes=2,
            compiled=True,  # Megatron's fused kernels
        )
        cluster = CLUSTERS["a100-80gb"]
    else:
        execution = Execution(
            overlap_tensor_parallel=True,
            overlap_gradient_reduction=True,
            overlap_parameter_gather=True,
            overlap_pipeline_transfers=True,
            gradient_bytes=4,
            parameter_bytes=2,
            compiled=True,  # Megatron's fused kernels
        )
        cluster = CLUSTERS["h100"]
    return shape, layout, cluster, execution


def published_flops(run: PublishedRun) -> float:
    """FLOPs of one step by the convention the source counted in (module docstring)."""
    L, h = run.layers, run.hidden
    if run.source == _PTD_P:
        s, V = 2048, 51_200
        return 96 * run.batch * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    s, V = 4096, 131_072
    return 12 * run.batch * s * L * h**2 * (6 + s / h + V / (2 * L * h))


@dataclass(frozen=True)
class Comparison:
    """A published row and its prediction."""

    run: PublishedRun
    step: StepTime
    predicted: float
    """Predicted TFLOP/s per GPU, in the source's convention."""

    @property
    def error(self) -> float:
        """Relative error of the predicted throughput: (predicted - published) / published."""
        return (self.predicted - self.run.tflops) / self.run.tflops

    def without(self, *terms: str) -> float:
        """The prediction with some terms of the step left out (``"pipeline_bubble"``, ...): a negative control."""
        seconds = self.step.total - sum(getattr(self.step, term) for term in terms)
        return published_flops(self.run) / (seconds * self.run.gpus) / 1e12


def compare(
    runs: tuple[PublishedRun, ...], cluster: Cluster | None = None, execution: Execution | None = None
) -> list[Comparison]:
    """Each row predicted with :func:`step_time`; ``cluster`` or ``execution`` replace the source's (controls)."""
    out = []
    for run in runs:
        shape, layout, default, how = _setup(run)
        step = step_time(shape, layout, cluster or default, execution or how)
        out.append(Comparison(run, step, published_flops(run) / (step.total * run.gpus) / 1e12))
    return out


def summary(comparisons: list[Comparison]) -> tuple[float, float]:
    """(mean absolute relative error, largest absolute relative error)."""
    errors = [abs(c.error) for c in comparisons]
    return sum(errors) / len(errors), max(errors)


def markdown(comparisons: list[Comparison]) -> str:
    """A table: the row, its layout, published and predicted TFLOP/s per GPU, the error, where the time goes."""
    lines = [
        "| model | t/p/d | M, mbs, V | published | predicted | error | compute | TP | bubble | DP | other |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        r, s = c.run, c.step
        parts = {k: v / s.total for k, v in s.breakdown().items()}
        other = parts["pipeline_transfers"] + parts["optimizer"] + parts["expert_all_to_all"]
        micro = r.batch // r.data // r.micro_batch_size
        lines.append(
            f"| {r.name} | {r.tensor}/{r.pipeline}/{r.data} | {micro}, {r.micro_batch_size}, {r.virtual_stages} "
            f"| {r.tflops:.1f} | {c.predicted:.1f} | {c.error:+.1%} | {parts['compute']:.0%} "
            f"| {parts['tensor_parallel']:.0%} | {parts['pipeline_bubble']:.0%} | {parts['data_parallel']:.0%} "
            f"| {other:.0%} |"
        )
    mae, worst = summary(comparisons)
    lines.append(f"\nMean absolute error {mae:.1%}, largest {worst:.1%}.")
    return "\n".join(lines)


def _main() -> None:
    for title, runs in (
        ("PTD-P Table 1, A100 (a100-80gb)", PTD_P),
        ("Megatron-LM README, H100 (h100)", MEGATRON_H100),
    ):
        print(f"**{title}**\n\n{markdown(compare(runs))}\n")


if __name__ == "__main__":
    _main()
