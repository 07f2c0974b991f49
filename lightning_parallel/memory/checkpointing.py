"""Activation checkpointing for unchanged modules: recompute instead of keeping activations.

Applied by patching the *instance's* ``forward`` (``block.forward = recomputed(block.forward)``),
never by wrapping the module: parameter names, state-dict keys and attribute paths stay the
user's. Whatever ``forward`` the instance has is chained (a pipeline stage's gate, for one),
and the module's own hooks stay outside the recomputed region, so they run once: the pipeline's
injection/exit hooks and the sequence-parallel scatter/gather on the first and last block. Hooks
of modules *inside* a recomputed block (tensor-parallel container hooks) run again during the
recomputation, on every tensor-parallel rank alike (all ranks recompute the same blocks in the
same order in backward), so their collectives stay matched.

- ``"full"``: every block is recomputed from its inputs; only the inputs are kept.
- ``"selective"``: with policy ``"ops"`` (the default), Megatron's selective recomputation as
  torch's selective activation checkpointing: inside every block, the outputs of the expensive
  ops (matmuls, attention kernels, collectives) are kept and the cheap ops (norms, activations,
  elementwise ops, softmax) are recomputed. With an integer ``k``, every ``k``-th block (0, k,
  2k, ...) is recomputed fully; with a list of module-name patterns (``fnmatch``, on names from
  ``named_modules()`` of the LightningModule), the matching modules are.

Built on ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and
``create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

import fnmatch
import functools
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from lightning_parallel.compat import TorchDispatchMode, selective_policy_sees_output
from lightning_parallel.memory.counting import SavedTensorCounter, active_counter

__all__ = [
    "CheckpointingConfig",
    "apply_activation_checkpointing",
    "is_checkpointed",
    "keep_op",
    "select_modules",
]

Mode = Literal["full", "selective"]
Policy = Literal["ops", "ops_alternate_matmuls"] | int | Sequence[str] | None
# Called at forward time; returns a context manager factory that restores that state for the recomputation.
StateCapture = Callable[[], Callable[[], AbstractContextManager[Any]]]


def _ops(*names: str) -> set[Any]:
    found = set()
    for name in names:
        namespace, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(packet)
    return found


# Expensive to recompute, so kept by selective checkpointing (torchtitan's list, as packets; the experts'
# grouped matmul too: found recomputed in backward by the engagement record of ep2 with "selective").
KEEP_OPS = _ops(
    "aten.mm",
    "aten.addmm",
    "aten.bmm",
    "aten.baddbmm",
    "aten._scaled_mm",
    "aten.linear",
    "aten._grouped_mm",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "_c10d_functional.all_reduce",
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_to_all_single",
)


def keep_op(op: Any) -> bool:
    """Whether selective checkpointing keeps this op's output (else it is recomputed)."""
    return getattr(op, "overloadpacket", op) in KEEP_OPS


@dataclass(frozen=True)
class CheckpointingConfig:
    """What to recompute; built and checked from the strategy's arguments at construction (``config/arguments.py``)."""

    mode: Mode
    every: int | None = None  # every k-th block, recomputed fully
    patterns: tuple[str, ...] = ()  # modules recomputed fully
    ops: bool = False  # op-level selective recomputation in every block
    alternate_matmuls: bool = (
        False  # ... recomputing every second projection matmul too (torchtitan's op policy)
    )

    def describe(self) -> str:
        if self.mode == "full":
            return "full (every block recomputed)"
        if self.ops and self.alternate_matmuls:
            return "selective (every second projection matmul and the cheap ops recomputed)"
        if self.ops:
            return "selective (matmul/attention/collective outputs kept, other ops recomputed)"
        if self.every is not None:
            return f"selective (every {self.every}-th block recomputed)"
        return f"selective (modules matching {list(self.patterns)} recomputed)"


def select_modules(
    root: nn.Module, config: CheckpointingConfig, block_names: Sequence[str]
) -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` pairs to recompute, in model order.

    ``block_names`` are the repeated blocks in forward order (all of them, also those another
    pipeline stage holds, so every k-th block means the same blocks under every layout).
    """
    if config.patterns:
        chosen = [
            (name, module)
            for name, module in root.named_modules()
            if name and any(fnmatch.fnmatchcase(name, p) for p in config.patterns)
        ]
        unmatched = [p for p in config.patterns if not any(fnmatch.fnmatchcase(n, p) for n, _ in chosen)]
        if unmatched:
            example = block_names[0] if block_names else next(n for n, _ in root.named_modules() if n)
            raise ValueError(
                f"`activation_checkpointing_policy` pattern(s) {unmatched} match no module of"
                f" {type(root).__name__}. Patterns are matched against names from `named_modules()`, for"
                f" example {example!r} or {example + '.*'!r}."
            )
        # A module inside another chosen one is already recomputed with it.
        names = [n for n, _ in chosen]
        return [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o in names)]
    if not block_names:
        raise ValueError(
            f"`activation_checkpointing={config.mode!r}`: no repeated block list (an nn.ModuleList of"
            f" same-class modules) was found in {type(root).__name__}. Name the modules to recompute with"
            " `activation_checkpointing='selective', activation_checkpointing_policy=['pattern', ...]`."
        )
    every = config.every or 1
    return [(name, root.get_submodule(name)) for index, name in enumerate(block_names) if index % every == 0]


def _count_keyword_inputs(kwargs: dict[str, Any]) -> None:
    # Positional inputs are saved through the saved-tensor hooks (torch's checkpoint saves them
    # as autograd saved tensors, so they are counted, offloaded and compressed like any other);
    # keyword arguments stay referenced by the recomputation closure.
    counter = active_counter()
    if counter is not None and kwargs:
        counter.hold(kwargs.values(), "inputs")


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if not keep_op(op):
        return CheckpointPolicy.PREFER_RECOMPUTE
    counter = active_counter()
    # torch 2.13 calls the policy once, after the op, with its output in ``ctx.op_output``; torch
    # 2.11 calls it before the op (no ``op_output``) and again while recomputing (``is_recompute``).
    # The decision is the same either way; on 2.11 ``_CountKept`` counts the kept outputs instead.
    output = getattr(ctx, "op_output", None)
    if counter is not None and output is not None and not getattr(ctx, "is_recompute", False):
        counter.hold(output if isinstance(output, (tuple, list)) else [output], "kept")
    return CheckpointPolicy.MUST_SAVE


# Projection matmuls (a linear's kernel): the ones ``"ops_alternate_matmuls"`` keeps only every second of.
PROJECTION_OPS = _ops("aten.mm", "aten.addmm", "aten._scaled_mm")


class _AlternateMatmuls:
    """The op policy, except that of the projection matmuls of one region only the 1st, 3rd, ... are kept.

    torchtitan's selective policy does the same: a block's matmul outputs are most of what op-level
    selective recomputation keeps, and rerunning half of them costs about a sixth of the block's forward
    again. The policy is asked once per op in forward and once per op while recomputing (2.11 also
    before the forward op); counting each pass apart keeps the two decisions aligned, and a region
    recomputed twice (zero-bubble schedules) counts again from its first matmul.
    """

    def __init__(self) -> None:
        self.forward = 0
        self.recompute = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if getattr(op, "overloadpacket", op) not in PROJECTION_OPS:
            return _selective_policy(ctx, op, *args, **kwargs)
        if getattr(ctx, "is_recompute", False):
            self.recompute += 1
            index = (self.recompute - 1) % max(self.forward, 1)
        else:
            if getattr(ctx, "op_output", None) is not None or not selective_policy_sees_output():
                self.forward += 1  # 2.13: once, after the op; 2.11: once, before it
            index = self.forward - 1
        if index % 2 == 1:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return _selective_policy(ctx, op, *args, **kwargs)


def _context_fn(
    *, ops: bool, capture: StateCapture | None, alternate: bool = False
) -> Callable[[], tuple[Any, Any]]:
    if not ops and capture is None:
        # torch's own no-op, by identity: under torch.compile any other context_fn must return
        # dispatch modes (the selective ones are), so nullcontexts would fail compilation.
        return noop_context_fn

    def make() -> tuple[Any, Any]:
        policy = _AlternateMatmuls() if alternate else _selective_policy
        forward_ctx, recompute_ctx = (
            create_selective_checkpoint_contexts(policy) if ops else (nullcontext(), nullcontext())
        )
        counter = active_counter()
        if ops and counter is not None and not selective_policy_sees_output():
            forward_ctx = _CountKept(forward_ctx, counter, policy if alternate else None)
        if capture is None:
            return forward_ctx, recompute_ctx
        return forward_ctx, _Both(capture(), recompute_ctx)

    return make


class _CountKept(TorchDispatchMode):
    """torch 2.11: counts the outputs selective checkpointing keeps, which its policy (run before the op)
    cannot see. Entered inside torch's caching mode (``caching``), so each op of the forward passes here
    first and reaches that mode from here; recomputation is not counted (this is the forward's context)."""

    def __init__(
        self, caching: Any, counter: SavedTensorCounter, alternate: _AlternateMatmuls | None = None
    ) -> None:
        super().__init__()
        self.caching, self.counter, self.alternate = caching, counter, alternate

    def __enter__(self) -> _CountKept:
        self.caching.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.caching.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))  # the policy (in the caching mode) has counted it by now
        skipped = (
            self.alternate is not None
            and func.overloadpacket in PROJECTION_OPS
            and self.alternate.forward % 2 == 0
        )
        if keep_op(func) and not skipped:
            self.counter.hold(out if isinstance(out, (tuple, list)) else [out], "kept")
        return out


class _Both:
    """A fresh ``first()`` context, then ``second``, entered in order at every recomputation.

    The recomputation context is entered once per recomputation, and a region is recomputed
    once per backward pass through it: twice under the zero-bubble schedules (input gradients,
    then weight gradients). ``first`` is a factory because a generator context enters once.
    """

    def __init__(
        self, first: Callable[[], AbstractContextManager[Any]], second: AbstractContextManager[Any]
    ) -> None:
        self.first, self.second = first, second
        self._entered: list[AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        context = self.first()
        context.__enter__()
        self._entered.append(context)
        self.second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self._entered.pop().__exit__(*exc)


def _recomputed(
    forward: Callable[..., Any], *, ops: bool, capture: StateCapture | None, alternate: bool = False
) -> Callable[..., Any]:
    context_fn = _context_fn(ops=ops, capture=capture, alternate=alternate)

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        _count_keyword_inputs(kwargs)
        if context_fn is noop_context_fn:  # not passed at all: dynamo traces the plain checkpoint
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    _RECOMPUTED.add(run)
    return run


# The forwards patched by ``_recomputed`` (so that a module is never wrapped twice).
_RECOMPUTED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return forward is not None and forward in _RECOMPUTED


def apply_activation_checkpointing(
    root: nn.Module,
    config: CheckpointingConfig,
    block_names: Sequence[str],
    *,
    skip: Callable[[nn.Module], bool] = lambda module: False,
    capture_state: StateCapture | None = None,
) -> list[str]:
    """Patch the forward of the modules ``config`` selects; returns their names.

    Args:
        root: the LightningModule (names are relative to it).
        config: see :class:`CheckpointingConfig`.
        block_names: the repeated blocks in forward order.
        skip: modules to leave alone (blocks another pipeline stage holds).
        capture_state: called at forward time; returns a context factory that restores, for the
            recomputation in backward, state the forward depended on (a pipeline stage's
            active-stage flag).
    """
    done = []
    for name, module in select_modules(root, config, block_names):
        if skip(module) or is_checkpointed(module):
            continue
        whole = not config.ops
        module.forward = _recomputed(  # type: ignore[method-assign]
            module.forward, ops=not whole, capture=capture_state, alternate=config.alternate_matmuls
        )
        done.append(name)
    return done
