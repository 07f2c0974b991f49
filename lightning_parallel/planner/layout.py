"""A layout to plan: every degree and option the strategy takes, and whether it can exist for a model.

:class:`Layout` mirrors ``HybridParallelStrategy``'s arguments (and the Trainer's precision and
batch), so a plan printed for a layout is the plan of the job those arguments start.
:func:`layout_problems` says why a layout cannot exist for a model on a number of devices: what only the
model's shapes tell (heads, experts and layers a degree must divide), then the strategy's own refusals
(:func:`strategy_refusals`: the arguments ``HybridParallelStrategy`` would receive, run through its
configuration, degrees and launch checks, so ``plan --search`` proposes no layout the strategy refuses at
setup: one rulebook). A layout with problems is reported as such, never predicted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_parallel.config.arguments import check_micro_batches, resolve_schedule, virtual_stages_for
from lightning_parallel.config.strategy_arguments import StrategyArguments
from lightning_parallel.config.validation import check_launch, strategy_config
from lightning_parallel.mesh import ParallelDims
from lightning_parallel.planner.shapes import ModelShape
from lightning_parallel.zero.arguments import ZERO_PRECISIONS, OffloadUpdate, ZeroArguments
from lightning_parallel.zero.engine_choice import engine_for

__all__ = ["PRECISIONS", "Layout", "layout_problems", "strategy_arguments", "strategy_refusals"]

#: Trainer precisions: (bytes of a parameter, of an activation, of a gradient).
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "32-true": (4, 4, 4),
    "bf16-mixed": (4, 2, 4),
    "16-mixed": (4, 2, 4),
    "bf16-true": (2, 2, 2),
    "16-true": (2, 2, 2),
}


@dataclass(frozen=True)
class Layout:
    """The strategy's degrees and options, the Trainer's precision and one rank's batch."""

    tensor_parallel: int = 1
    sequence_parallel: bool = False
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int = 1
    micro_batches: int = 1
    """Micro-batches per optimizer step: the pipeline's, or without stages ``accumulate_grad_batches``."""
    data_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    """Ranks that split each sequence (carved out of ``data_parallel``, as the strategy does: ``dp / cp`` replicas
    read distinct batches, each rank holds ``sequence_length / cp`` tokens of every sequence)."""
    context_parallel_mode: str = "ring"
    """``"ring"`` (keys and values passed around the ``cp`` ranks) or ``"ulysses"`` (all-to-all over heads)."""
    zero_stage: int = 0
    offload: str | None = None
    """None, ``"cpu"`` or ``"nvme"``: where ZeRO keeps the optimizer states (stage 3: parameters too)."""
    zero_engine: str = "auto"
    """The strategy's ``zero_engine``: ``"auto"`` (by layout), ``"deepspeed"`` or ``"fsdp2"``."""
    offload_update: OffloadUpdate = "exact"
    """The strategy's ``offload_update``: ``"exact"``, ``"delayed"`` (step i's host step during step i+1) or an
    ``ImportanceSplit`` (the chosen rows at once, the others later)."""
    zero_gather_dtype: str = "stored"
    """The strategy's ``zero_gather_dtype``: ``"stored"`` (ZeRO gathers the parameters as kept: fp32 under the mixed
    precisions) or ``"compute"`` (FSDP2 gathers 16-bit copies, as Megatron and torchtitan do)."""
    activation_checkpointing: str | None = None
    """None, ``"full"`` or ``"selective"``."""
    activation_checkpointing_policy: str = "ops"
    """With ``"selective"``: ``"ops"`` (every matmul output kept) or ``"ops_alternate_matmuls"`` (every second
    projection matmul of a block recomputed, as torchtitan): the strategy's argument of the same name."""
    precision: str = "32-true"
    micro_batch_size: int = 1
    """Sequences in one micro-batch (the DataLoader's batch size under pipeline stages: M of them)."""
    sequence_length: int = 1024
    attention: str = "flash"
    """``"flash"`` (fused attention keeps no score matrix) or ``"eager"`` (keeps softmax scores)."""
    optimizer: str = "adamw"
    """``"adamw"``/``"adam"`` (two fp32 states), ``"sgd"`` (momentum: one), ``"adafactor"`` (factored)."""
    compile: bool = False
    """The strategy's ``compile``: ``torch.compile`` fuses the memory-bound ops eager PyTorch runs one by one
    (``Execution.compiled``)."""
    loss_parallel: bool | None = None
    """The strategy's ``loss_parallel``: None (default) and True keep the loss on the vocabulary shards of a
    sharded head (``tensor_parallel/vocab_loss.py``); False gathers the logits for it."""
    activation_offload: bool = False
    """The strategy's ``activation_offload``: the tensors saved for backward wait in host memory, but for each
    micro-batch the last block's (and the head's after it), the gathered inputs kept as slices and what
    selective recomputation keeps (``memory/saved_tensors.py``)."""
    activation_compression: str | None = None
    """The strategy's ``activation_compression``: ``"bf16"`` or ``"fp8"`` stores the floating-point tensors
    saved for backward in 2 or 1 bytes an element (not the gathered inputs kept as slices, nor what selective
    recomputation keeps)."""

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel * self.pipeline_virtual_stages

    @property
    def batch_per_replica(self) -> int:
        """Sequences a data-parallel replica trains on per optimizer step."""
        return self.micro_batch_size * max(self.micro_batches, 1)

    @property
    def global_batch(self) -> int:
        return self.batch_per_replica * self.data_parallel // self.context_parallel

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch on one rank: each of ``cp`` ranks holds a slice of every sequence."""
        return self.micro_batch_size * self.sequence_length // self.context_parallel

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def short(self) -> str:
        """``tp2 sp pp4(1f1b, M=8) dp8 ep2 zero1`` and the options that are on."""
        parts = [f"tp{self.tensor_parallel}" + (" sp" if self.sequence_parallel else "")]
        if self.pipeline_parallel > 1:
            virtual = f" v{self.pipeline_virtual_stages}" if self.pipeline_virtual_stages > 1 else ""
            parts.append(
                f"pp{self.pipeline_parallel}({self.pipeline_schedule}{virtual}, M={self.micro_batches})"
            )
        elif self.micro_batches > 1:
            parts.append(f"acc{self.micro_batches}")
        parts.append(f"dp{self.data_parallel}")
        if self.context_parallel > 1:
            parts.append(
                f"cp{self.context_parallel}"
                + ("(ulysses)" if self.context_parallel_mode == "ulysses" else "")
            )
        if self.expert_parallel > 1:
            parts.append(f"ep{self.expert_parallel}")
        if self.zero_stage:
            delayed = "" if self.offload_update == "exact" else f"({self.offload_update})"
            gathers = "(16-bit gathers)" if self.zero_gather_dtype == "compute" else ""
            parts.append(
                f"zero{self.zero_stage}{gathers}" + (f"+{self.offload}{delayed}" if self.offload else "")
            )
        if self.activation_checkpointing:
            alternate = self.activation_checkpointing_policy == "ops_alternate_matmuls"
            parts.append(
                f"ckpt:{self.activation_checkpointing}" + ("(alternate matmuls)" if alternate else "")
            )
        if self.activation_compression or self.activation_offload:
            where = "host" if self.activation_offload else ""
            parts.append("saved:" + "+".join(x for x in (self.activation_compression, where) if x))
        parts.append(f"mbs{self.micro_batch_size}")
        return " ".join(parts)


def _divides(problems: list[str], what: str, value: int, degree: int, name: str) -> None:
    if value and value % degree:
        problems.append(f"{what} ({value}) is not divisible by `{name}={degree}`")


def _zero_problems(problems: list[str], layout: Layout) -> None:
    """The refusals of ``config/validation.py`` that need the degrees: what ZeRO cannot shard or run in."""
    if not layout.zero_stage:
        return

    if layout.precision not in ZERO_PRECISIONS:
        problems.append(f"`precision={layout.precision!r}` with ZeRO: one of {sorted(ZERO_PRECISIONS)}")
    ep, dp = layout.expert_parallel, layout.data_parallel
    if layout.offload in (None, "cpu", "nvme") and layout.zero_stage in (1, 2, 3):
        engine = zero_engine(layout)
        if ep > 1 and dp // ep == 1 and engine == "deepspeed":
            problems.append(
                f"`zero_stage={layout.zero_stage}` with `expert_parallel={ep}` on {dp} data-parallel ranks"
                " shards nothing on DeepSpeed's engine (it shards over each expert's replicas)"
            )


def zero_engine(layout: Layout) -> str | None:
    """The engine ZeRO runs ``layout`` on (None without ZeRO), as the strategy picks it (``zero/engine_choice.py``)."""
    zero = ZeroArguments(
        stage=layout.zero_stage,
        offload=layout.offload,  # type: ignore[arg-type]
        engine=layout.zero_engine,  # type: ignore[arg-type]
        update=layout.offload_update,  # type: ignore[arg-type]
        gather_dtype=layout.zero_gather_dtype,  # type: ignore[arg-type]
    )
    return engine_for(
        zero, layout.tensor_parallel, layout.pipeline_parallel, expert_parallel=layout.expert_parallel
    )


def gathered_parameter_bytes(layout: Layout) -> int | None:
    """Bytes per element of ZeRO's parameter all-gathers and of the gathered copies: 2 where FSDP2 gathers in the
    16-bit compute dtype (``zero_gather_dtype="compute"``), None where they are the stored parameters."""
    if layout.zero_gather_dtype == "compute" and zero_engine(layout) == "fsdp2":
        return 2
    return None


def layout_problems(layout: Layout, shape: ModelShape, gpus: int | None = None) -> list[str]:
    """Why ``layout`` cannot run ``shape`` (on ``gpus`` devices when given); empty when it can."""
    problems: list[str] = []
    for name in (
        "tensor_parallel",
        "pipeline_parallel",
        "data_parallel",
        "expert_parallel",
        "context_parallel",
        "micro_batches",
        "micro_batch_size",
        "sequence_length",
        "pipeline_virtual_stages",
    ):
        value = getattr(layout, name)
        if not isinstance(value, int) or value < 1:
            problems.append(f"`{name}={value!r}` must be a positive integer")
    if problems:
        return problems
    if layout.precision not in PRECISIONS:
        problems.append(f"`precision={layout.precision!r}` is not one of {sorted(PRECISIONS)}")
    if gpus is not None and layout.gpus != gpus:
        problems.append(
            f"tp x pp x dp = {layout.tensor_parallel} x {layout.pipeline_parallel} x {layout.data_parallel}"
            f" = {layout.gpus} devices, not the {gpus} given"
        )
    tp, ep = layout.tensor_parallel, layout.expert_parallel
    block = shape.blocks[0]
    _divides(problems, "attention heads", block.heads, tp, "tensor_parallel")
    if block.kv_heads and block.kv_heads % tp and tp % block.kv_heads:
        problems.append(f"k/v heads ({block.kv_heads}) and `tensor_parallel={tp}`: neither divides the other")
    _divides(problems, "MLP width", block.ffn_hidden, tp, "tensor_parallel")
    if layout.sequence_parallel:
        if tp == 1:
            problems.append("`sequence_parallel=True` needs `tensor_parallel` > 1")
        _divides(problems, "sequence length", layout.sequence_length, tp, "tensor_parallel")
        if any(b.num_experts for b in shape.blocks) and ep > 1:  # with ep = 1 each rank routes its slice
            problems.append(
                f"`sequence_parallel=True` with `expert_parallel={ep}`: the strategy refuses the pair (its routing"
                " would see only the rank's slice of the sequence)"
            )
    cp = layout.context_parallel
    if cp > 1:
        # ring: a head and a tail chunk per rank
        chunks = 2 * cp if layout.context_parallel_mode == "ring" else cp
        if layout.sequence_length % chunks:
            problems.append(
                f"sequence length ({layout.sequence_length}) is not divisible into {chunks} chunks"
                f" (`context_parallel={cp}`, {layout.context_parallel_mode})"
            )
        if layout.context_parallel_mode == "ulysses" and (block.heads // tp) % cp:
            problems.append(
                f"`context_parallel_mode='ulysses'`: {block.heads // tp} heads per tensor rank are not"
                f" divisible by `context_parallel={cp}`"
            )
    if ep > 1:
        experts = max((b.num_experts for b in shape.blocks), default=0)
        if not experts:
            problems.append(f"`expert_parallel={ep}` but the model has no routed experts")
        _divides(problems, "routed experts", experts, ep, "expert_parallel")
        _divides(
            problems,
            "data-parallel ranks (experts are sharded over them)",
            layout.data_parallel,
            ep,
            "expert_parallel",
        )
    if layout.pipeline_parallel > 1:
        try:
            spec = resolve_schedule(layout.pipeline_schedule)
            virtual = virtual_stages_for(spec, layout.pipeline_virtual_stages if spec.multi_stage else None)
            if virtual != layout.pipeline_virtual_stages:
                problems.append(f"the {spec.name!r} schedule holds {virtual} stages per rank")
            check_micro_batches(spec, layout.micro_batches, layout.pipeline_parallel)
        except ValueError as error:
            problems.append(str(error).rstrip("."))
        if layout.num_stages > shape.num_layers:
            problems.append(f"{layout.num_stages} pipeline stages but only {shape.num_layers} blocks")
    _zero_problems(problems, layout)
    if layout.zero_stage not in (0, 1, 2, 3):
        problems.append(f"`zero_stage={layout.zero_stage}` must be 0, 1, 2 or 3")
    if layout.offload not in (None, "cpu", "nvme"):
        problems.append(f"`offload={layout.offload!r}` must be None, 'cpu' or 'nvme'")
    elif layout.offload and not layout.zero_stage:
        problems.append(f"`offload={layout.offload!r}` needs `zero_stage` >= 1")
    elif layout.offload == "nvme" and layout.zero_stage < 2:
        problems.append("`offload='nvme'` needs `zero_stage` 2 or 3")
    if layout.activation_checkpointing not in (None, "full", "selective"):
        problems.append(
            f"`activation_checkpointing={layout.activation_checkpointing!r}` must be None, 'full' or 'selective'"
        )
    if layout.activation_checkpointing_policy not in ("ops", "ops_alternate_matmuls"):
        problems.append(
            f"`activation_checkpointing_policy={layout.activation_checkpointing_policy!r}` must be 'ops' or"
            " 'ops_alternate_matmuls' (the planner models these two selective policies)"
        )
    if layout.loss_parallel not in (None, True, False):
        problems.append(f"`loss_parallel={layout.loss_parallel!r}` must be None, True or False")
    if layout.attention not in ("flash", "eager"):
        problems.append(f"`attention={layout.attention!r}` must be 'flash' or 'eager'")
    if not problems:  # the strategy's own rules on the arguments it would receive
        problems += strategy_refusals(layout)
    return problems


# ---- one rulebook: the strategy's own refusals, asked of a planned layout ---------------------------

_NVME_PLACEHOLDER = "/local_nvme"  # the strategy asks where; the planner plans the bytes, not the folder


def strategy_arguments(layout: Layout) -> StrategyArguments:
    """The arguments ``HybridParallelStrategy`` runs ``layout`` with."""
    pipelined = layout.pipeline_parallel > 1
    selective = layout.activation_checkpointing == "selective"
    return StrategyArguments(
        tensor_parallel=layout.tensor_parallel,
        pipeline_parallel=layout.pipeline_parallel,
        expert_parallel=layout.expert_parallel,
        context_parallel=layout.context_parallel,
        context_parallel_mode=layout.context_parallel_mode,  # type: ignore[arg-type]
        sequence_parallel=layout.sequence_parallel,
        micro_batches=layout.micro_batches if pipelined else None,
        pipeline_schedule=layout.pipeline_schedule if pipelined else None,
        pipeline_virtual_stages=layout.pipeline_virtual_stages
        if pipelined and layout.pipeline_virtual_stages > 1
        else None,
        zero_stage=layout.zero_stage,
        offload=layout.offload,  # type: ignore[arg-type]
        offload_path=_NVME_PLACEHOLDER if layout.offload == "nvme" else None,
        zero_engine=layout.zero_engine,  # type: ignore[arg-type]
        offload_update=layout.offload_update,  # type: ignore[arg-type]
        zero_gather_dtype=layout.zero_gather_dtype,  # type: ignore[arg-type]
        activation_checkpointing=layout.activation_checkpointing,  # type: ignore[arg-type]
        activation_checkpointing_policy=(
            layout.activation_checkpointing_policy
            if selective and layout.activation_checkpointing_policy != "ops"
            else None
        ),  # type: ignore[arg-type]
        loss_parallel=layout.loss_parallel,
        compile=layout.compile,
        activation_offload=layout.activation_offload,
        activation_compression=layout.activation_compression,  # type: ignore[arg-type]
    )


def _precision_plugin(precision: str) -> Any:
    """The plain plugin ``Trainer(precision=...)`` makes (only its type and name are read)."""

    if precision.endswith("-mixed"):
        return MixedPrecision(precision, "cpu")  # type: ignore[arg-type]
    if precision in ("bf16-true", "16-true"):
        return HalfPrecision(precision)  # type: ignore[arg-type]
    return Precision()


def strategy_refusals(layout: Layout) -> list[str]:
    """The strategy's refusal of ``layout`` (its ``ValueError``), or nothing when it accepts it."""
    try:
        config = strategy_config(strategy_arguments(layout))
        dims = ParallelDims(
            world_size=layout.gpus,
            tensor_parallel=layout.tensor_parallel,
            pipeline_parallel=layout.pipeline_parallel,
            expert_parallel=layout.expert_parallel,
            context_parallel=layout.context_parallel,
        )
        check_launch(config, dims, _precision_plugin(layout.precision))
    except ValueError as error:
        return [f"HybridParallelStrategy refuses it: {error}"]
    return []
