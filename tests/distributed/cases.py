"""Named training cases for the parity harness.

A :class:`Case` is plain, picklable data: the harness pickles it to the worker processes, which
build the strategy, the module and the ``Trainer`` from it. Add a case with one line at the
bottom of this file (or build one inline in a test)::

    hybrid("nanogpt_tp2_sp", "nanogpt", world_size=2, tensor_parallel=2, sequence_parallel=True)

The reference for a case (one process, global batch) depends only on ``reference_key()``:
cases that differ only by strategy or world size share one reference run.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "ATOL",
    "CASES",
    "RTOL",
    "Case",
    "Fault",
    "GradientFault",
    "StrategySpec",
    "ddp",
    "hybrid",
    "register",
]

# Project rules for fp32 parity (docs/testing.md): never widen these to make a test pass.
RTOL = 1e-5
ATOL = 1e-6


@dataclass(frozen=True)
class StrategySpec:
    """A strategy to build in the worker: ``"module:Class"`` plus keyword arguments.

    Data rather than an object, so that cases pickle and ``cases.py`` imports even before the
    strategy class exists.
    """

    target: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def build(self) -> Any:
        module_name, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module_name), attr)(**self.kwargs)


@dataclass(frozen=True)
class Fault:
    """Test-only misbehaviour injected at the start of batch ``batch_idx`` on ``rank``.

    ``raise``: raise an exception. ``exit0``: leave the process with status 0 mid-run (a rank
    that swallowed its error). ``hang``: sleep, leaving the other ranks blocked in a collective.
    """

    rank: int
    kind: Literal["raise", "exit0", "hang"] = "raise"
    batch_idx: int = 1


@dataclass(frozen=True)
class GradientFault:
    """Test-only: multiply the gradients of the parameters whose name contains ``name`` by ``factor``.

    Applied in the distributed run just before each optimizer step (``0.0``: the layer's
    gradient dropped; ``2.0``: doubled), never in the reference: the negative control of a
    parity test, which must then fail.
    """

    name: str
    factor: float


@dataclass(frozen=True)
class Case:
    """One training run: a model family trained ``steps`` optimizer steps under ``strategy``.

    Args:
        name: Unique; keys the results.
        family: A key of ``tests.models.families.FAMILIES``.
        strategy: A Lightning strategy name (``"ddp"``) or a :class:`StrategySpec`.
        world_size: Processes in the launch.
        data_parallel: Data-parallel replicas (the ``num_replicas`` of the strategy's sampler);
            ``None`` means ``world_size``. The reference trains on ``batch_size * data_parallel``.
        steps: Optimizer steps (``Trainer(max_steps=...)``).
        batch_size: Samples per data-parallel rank per batch.
        trainer_kwargs: Extra ``Trainer`` arguments, e.g. ``precision``, ``accumulate_grad_batches``,
            ``gradient_clip_val``; applied to the reference too.
        model_kwargs: Overrides for the family's constructor (``learning_rate``, ...).
        seed: ``seed_everything`` seed; the initial weights come from the family's own seed.
        data: ``"random"`` tokens or a ``"learnable"`` sequence (``tests.models.families.TokenWindows``):
            low-precision cases train on the learnable one, where the loss moves.
        reversed_batches: Reference only: each global batch in the reverse order, the run whose
            spread from the natural order derives the low-precision tolerance.
        fault: Test-only fault injection; ``None`` in real cases.
        gradient_fault: Test-only wrong gradient (a negative control); ``None`` in real cases.
        callbacks: Callbacks of the run, built in the worker (``StrategySpec`` also names a callback
            class): applied to the reference too, they are part of what is compared (pruning).
        switch_off: Test-only: ``"row_copies"`` stops summing the gradient copies of rows stored on several
            tensor-parallel ranks. ``"activation_checkpointing"`` undoes the strategy's recomputation
            when training starts (same numbers, the feature silently off: a negative control of
            the engagement record). ``"zero_autocast"``: DeepSpeed's engine config without its
            ``torch_autocast`` section (as before issue 33: the engine switches autocast off), a negative
            control of the compute-dtype record; ``"grouped_mm_autocast"``: torch's grouped matmul without the
            autocast rule the precision plugins register (Hugging Face's MoE experts in fp32), another;
            ``"compute_gathers"``: ``zero_gather_dtype="compute"`` ignored (FSDP2 gathers fp32), the negative
            control of the gather-dtype record. ``"host_step_wait"``: FSDP2's offloaded shards stepped during
            backward although clipping needs the whole backward first (a negative control of the parity rule
            for the overlapped host step); the names of ``tests/distributed/plan_switches.py`` take one way of
            sharding attention away from the automatic plan; ``None`` in real cases.
        gpu_checks: The CUDA-only checks of DeepSpeed made to see the CPU's autocast, as they see CUDA's on a
            GPU (tests/distributed/gpu_checks.py); ``False`` only to show what that emulation reveals.
        reference_rule: A numerics contract other than the Trainer precision's that the one-process reference
            implements by itself: ``"compute_weights"`` (``zero_gather_dtype="compute"``): each forward uses a
            compute-dtype copy of every parameter, whose gradient (several uses summed in that dtype) reaches
            the fp32 parameter through the cast (tests/distributed/worker.py: ``compute_weight_copies``).
    """

    name: str
    family: str
    strategy: str | StrategySpec = "ddp"
    world_size: int = 2
    data_parallel: int | None = None
    steps: int = 4
    batch_size: int = 2
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    data: str = "random"
    reversed_batches: bool = False
    fault: Fault | None = None
    gradient_fault: GradientFault | None = None
    switch_off: str | None = None
    callbacks: tuple[StrategySpec, ...] = ()
    gpu_checks: bool = True
    reference_rule: str | None = None

    @property
    def dp(self) -> int:
        return self.world_size if self.data_parallel is None else self.data_parallel

    @property
    def batches(self) -> int:
        """Training batches per rank: ``steps`` times the accumulation."""
        return self.steps * int(self.trainer_kwargs.get("accumulate_grad_batches", 1))

    @property
    def num_samples(self) -> int:
        """Dataset length: exactly one epoch of ``batches`` global batches."""
        return self.batches * self.batch_size * self.dp

    def reference_key(self) -> tuple:
        """Everything the single-process reference depends on (not the strategy, not the world size)."""
        return (
            self.family,
            self.dp,
            self.steps,
            self.batch_size,
            tuple(sorted((k, repr(v)) for k, v in self.trainer_kwargs.items())),
            tuple(sorted((k, repr(v)) for k, v in self.model_kwargs.items())),
            self.seed,
            self.data,
            self.reversed_batches,
            repr(self.callbacks),
            self.reference_rule,
        )

    def replace(self, **changes: Any) -> Case:
        return dataclasses.replace(self, **changes)


CASES: dict[str, Case] = {}


def register(*cases: Case) -> tuple[Case, ...]:
    """Add cases to ``CASES`` by name; a duplicate name is an error."""
    for case in cases:
        if case.name in CASES:
            raise ValueError(f"Duplicate case name {case.name!r}")
        CASES[case.name] = case
    return cases


def ddp(name: str, family: str, world_size: int = 2, **fields: Any) -> Case:
    """Register a case under Lightning's own ``DDPStrategy`` (gloo on CPU)."""
    spec = StrategySpec("lightning.pytorch.strategies:DDPStrategy", {"process_group_backend": "gloo"})
    return register(Case(name, family, spec, world_size=world_size, **fields))[0]


def hybrid(
    name: str,
    family: str,
    world_size: int = 2,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    case_fields: Mapping[str, Any] | None = None,
    **strategy_kwargs: Any,
) -> Case:
    """Register a case under ``lightning_parallel.HybridParallelStrategy(**strategy_kwargs)``.

    Data parallel is what tensor and pipeline parallel leave (expert parallel is carved out of
    it, so it does not change the data split; context parallel is carved out of it too, and its
    ranks share their batch, so the data split is what it leaves). ``case_fields`` sets other :class:`Case` fields
    (``steps``, ``trainer_kwargs``, ...). ``zero_gather_dtype="compute"`` brings its reference rule
    (``Case.reference_rule``): the one-process run of that numerics, not of the plain precision.
    """
    if world_size % (tensor_parallel * pipeline_parallel):
        raise ValueError(f"{name}: world_size {world_size} is not divisible by tp*pp")
    if strategy_kwargs.get("zero_gather_dtype") == "compute":
        case_fields = {"reference_rule": "compute_weights", **(case_fields or {})}
    kwargs = dict(strategy_kwargs, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    spec = StrategySpec("lightning_parallel:HybridParallelStrategy", kwargs)
    dp = world_size // (tensor_parallel * pipeline_parallel * strategy_kwargs.get("context_parallel", 1))
    return register(Case(name, family, spec, world_size=world_size, data_parallel=dp, **(case_fields or {})))[
        0
    ]


# --- Cases -------------------------------------------------------------------------------------
# Validation of the harness itself, under Lightning's DDPStrategy.
ddp("ddp2_nanogpt", "nanogpt")
ddp("ddp2_hf_gpt2", "hf_gpt2")
ddp("ddp2_hf_llama", "hf_llama")
ddp(
    "ddp2_nanogpt_accum_clip",
    "nanogpt",
    trainer_kwargs={"accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
)
ddp("ddp2_recipe_gpt", "recipe_gpt")
