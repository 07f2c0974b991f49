"""ZeRO-3 as torch's FSDP2 (``fully_shard``) over the data-parallel ranks of tensor-parallel DTensor weights.

torchtitan's 2-D layout: each tensor-parallel shard is sharded again over ``dp``, so a rank holds
``1 / (tp x dp)`` of every weight, its gradient and its optimizer state (the ZeRO-3 memory
contract); a block's weights are all-gathered over ``dp`` just before it runs (forward, and again
in backward) and its gradients reduce-scattered right after, overlapping the backward of the
blocks below. Each block is one unit (its own all-gather), the rest of each top-level module
another; the LightningModule itself is never one (Lightning calls ``training_step``, not
``forward``, so its hooks would not fire).

Over ``dp`` FSDP2 shards each weight along a dim tensor parallelism does not cut (a column-parallel
weight along its input features, a row-parallel one along its outputs, ``shard_placement``): on the
dim tensor parallelism cuts it would nest a strided placement inside the ``tp`` one, which mixed
rows (measured: a fused q|k|v bias wrong after one step; column-parallel biases under pipeline
micro-batches). The vectors tensor parallelism cuts (column-parallel biases) have no other dim;
those few stay whole over ``dp`` (``ignored_params``) and their gradients are averaged over ``dp``
after backward, with the other explicit reductions (``parallelize/gradients.py``).

Expert weights (expert parallelism) are units of their own, sharded over the expert-data-parallel
ranks (``dp_replicate``: the ranks holding the same experts), as torchtitan's expert FSDP: the ep
slices stay where expert parallelism put them and each is cut again, along its second dim (the
first is the expert dim the ep slices cut, so a checkpoint can describe the rank's piece as one
box of the stacked tensor: ``checkpoint/layouts.py``). Their reduce-scatter sums over the replicas
and divides by the whole data-parallel size (an expert's gradient already holds the tokens of its
ep group), with sum-only collectives (gloo has no pre-multiplied sum).

``offload="cpu"``: FSDP2's ``CPUOffloadPolicy``: the sharded parameters, their gradients and the
optimizer (state and step) live on the CPU, copied to the device for each all-gather.

``zero_gather_dtype="compute"``: FSDP2's ``MixedPrecisionPolicy`` casts each shard to the autocast dtype before
the all-gather (half the bytes of fp32 over the links, and the matmuls find their weights already cast);
gradients are reduced and kept in fp32 (``gather_policy``). Every unit gathers so, the embeddings too: the
residual stream starts in 16 bits and stays there (torchtitan's ``param_dtype``, Megatron's 16-bit parameters;
under ``16-mixed`` a forward that overflows fp16 is not mended by the loss scale). Gathering the blocks alone
would keep it fp32 as in the one-process run, but a block's norm then meets an fp32 input with a 16-bit weight,
which the CPU's layer norm refuses (CUDA's autocast computes it in fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

from lightning_parallel.compat import (
    StridedShard,
    fsdp_accumulate_in_reduce_dtype,
    fsdp_param_groups,
    fsdp_state,
)
from lightning_parallel.experts import expert_shard
from lightning_parallel.experts.detection import SHARD_ATTR
from lightning_parallel.tensor_parallel.row_layout import ROW_LAYOUT, stamp_row_layouts
from lightning_parallel.zero.arguments import ZeroArguments
from lightning_parallel.zero.precision import AUTOCAST


def _tensor_parallel_dims(param: nn.Parameter) -> set[int]:
    """The tensor dims tensor parallelism already cuts (plain and strided shards)."""
    if not isinstance(param, DTensor):
        return set()
    return {p.dim for p in param.placements if isinstance(p, (Shard, StridedShard))}


def shard_placement(param: nn.Parameter) -> Shard:
    """FSDP2's placement over ``dp``: the first dim tensor parallelism does not cut.

    Sharding a dim that tensor parallelism cuts makes FSDP2 nest a strided placement over ``dp`` inside
    the ``tp`` one, which gave wrong rows under pipeline micro-batches (and for fused q|k|v always).
    """
    taken = _tensor_parallel_dims(param)
    return Shard(next((d for d in range(param.dim()) if d not in taken), 0))


def unsharded_parameters(root: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP2 leaves whole over ``dp``: vectors tensor parallelism already cuts (the biases of
    column-parallel projections), which have no other dim to shard."""
    return [p for p in root.parameters() if p.dim() == 1 and _tensor_parallel_dims(p)]


def _holders(root: nn.Module, skip: set[int]) -> list[nn.Module]:
    """Children of ``root`` that own parameters (containers opened), not already units."""
    found, pending = [], [c for c in root.children() if any(True for _ in c.parameters())]
    while pending:
        child = pending.pop(0)
        if id(child) in skip:
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            pending[:0] = [c for c in child.children() if any(True for _ in c.parameters())]
        else:
            found.append(child)
    return found


def expert_placement(param: nn.Parameter, replicas: int) -> Shard:
    """FSDP2's placement of an expert weight over its replicas: past the expert dim of a stacked weight.

    FSDP2 shards a dim other than 0 evenly only, so the first later dim that ``replicas`` divides.
    """
    mark = expert_shard(param)
    if mark is None or mark.dim is None:  # a ModuleList expert: one whole expert, any dim
        return Shard(0)
    for dim in range(1, param.dim()):
        if param.shape[dim] % replicas == 0:
            return Shard(dim)
    raise ValueError(
        f"ZeRO with `expert_parallel`: an expert weight of shape {tuple(param.shape)} has no dim past the expert"
        f" dim that its {replicas} expert-data-parallel replicas divide (FSDP2 shards those evenly only). Choose"
        " a data-parallel degree over `expert_parallel` that divides the experts' hidden sizes."
    )


@dataclass(frozen=True)
class ExpertSharding:
    """How expert weights are sharded: over ``mesh`` (their replicas), gradients divided by ``data_parallel``."""

    mesh: DeviceMesh
    data_parallel: int


def _expert_owners(root: nn.Module) -> list[tuple[nn.Module, dict[str, object]]]:
    """Modules that register expert parameters themselves, with each parameter's ``ExpertShard``."""
    owners = []
    for module in root.modules():
        marks = {n: expert_shard(p) for n, p in module.named_parameters(recurse=False)}
        marks = {n: m for n, m in marks.items() if m is not None}
        if marks:
            owners.append((module, marks))
    return owners


@dataclass
class Sharded:
    """What ``fully_shard_modules`` made: the FSDP2 units, and the parameters it left whole over ``dp``."""

    units: list[nn.Module]
    whole: list[nn.Parameter]


KEPT_ON_DEVICE = "_lp_kept_on_device"  # set on the sharded parameters of units partial offload leaves alone


def fully_shard_modules(
    root: nn.Module,
    dp_mesh: DeviceMesh,
    blocks: list[nn.Module],
    *,
    offload: bool,
    reshard_after_forward: bool = True,
    experts: ExpertSharding | None = None,
    offload_ratio: float = 1.0,
    gather_dtype: torch.dtype | None = None,
) -> Sharded:
    """``fully_shard`` the expert weights (``experts``), every block, then every other parameter-holding
    child of ``root``; with ``offload``, the units :func:`offloaded_units` picks for ``offload_ratio``;
    with ``gather_dtype``, each unit gathers its parameters in it (:func:`gather_policy`)."""

    whole = unsharded_parameters(root)  # before sharding: afterwards every parameter is a DTensor over dp
    expert_owners = [owner for owner, _ in _expert_owners(root)] if experts is not None else []
    kept_blocks = [block for block in blocks if any(True for _ in block.parameters())]
    holders = _holders(root, {id(m) for m in expert_owners + kept_blocks})
    offloaded = (
        offloaded_units(expert_owners + kept_blocks + holders, set(whole), offload_ratio)
        if offload
        else set()
    )

    def options(module: nn.Module) -> tuple[dict, bool]:
        """``fully_shard``'s arguments for ``module``, and whether partial offload keeps it on the device."""
        cpu = id(module) in offloaded
        return {
            "reshard_after_forward": reshard_after_forward,
            "mesh": dp_mesh,
            "shard_placement_fn": shard_placement,
            "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if cpu
            else OffloadPolicy(),
            "ignored_params": set(whole),
            "mp_policy": gather_policy(gather_dtype),
        }, offload and not cpu

    units = _shard_experts(root, experts, options) if experts is not None else []
    units += [
        _shard(module, kwargs, kept=kept)
        for module in kept_blocks + holders
        for kwargs, kept in [options(module)]
    ]
    if reshard_after_forward:
        prefetch_offloaded_blocks(kept_blocks, offloaded)
    # FSDP2's new parameters name their row layouts again (tensor_parallel/row_layout.py).
    stamp_row_layouts(root)
    return Sharded(units, whole)


def gather_dtype_for(zero: ZeroArguments, precision: str) -> torch.dtype | None:
    """The dtype the units gather in for ``zero_gather_dtype`` under ``Trainer(precision=precision)`` (None: as
    stored). The launch refused ``"compute"`` without an autocast dtype (``config/validation.py``)."""
    return AUTOCAST[precision] if zero.gather_dtype == "compute" else None


def gather_policy(gather_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``gather_dtype`` (None: FSDP2's default, nothing cast).

    The all-gather carries ``gather_dtype``; the unsharded gradients come back in it and are cast to fp32
    before the reduce-scatter (``reduce_dtype``; FSDP2 would otherwise reduce in the gather dtype) and kept
    in fp32 as the sharded gradients the optimizer steps. Forward inputs are not cast
    (``cast_forward_inputs=False``): a unit computes with the dtypes its own parameters and inputs give.
    """
    if gather_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=gather_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def prefetch_offloaded_blocks(blocks: list[nn.Module], offloaded: set[int]) -> None:
    """ZeRO-3 with parameters in host memory: each block's forward also starts gathering the next block's (copy
    up from the host, all-gather), so that copy runs during this block's compute instead of before the next's.

    FSDP2 gathers a unit in its own pre-forward hook by default; in backward it already prefetches the unit
    below. One block ahead costs one more block's whole parameters on the device (torchtitan's explicit
    forward prefetch does the same)."""
    for block, following in zip(blocks, blocks[1:], strict=False):
        if id(following) in offloaded:
            cast(FSDPModule, block).set_modules_to_forward_prefetch([cast(FSDPModule, following)])


def offloaded_units(modules: list[nn.Module], whole: set[nn.Parameter], ratio: float) -> set[int]:
    """Ids of the units to offload so that their parameters come nearest to ``ratio`` of all (in order, each
    unit taken while it brings the offloaded fraction no further past the ratio than short of it).

    A unit's parameters are those it holds that no earlier unit does (units nest: experts in blocks,
    blocks in the top-level holders), as FSDP2 assigns them.
    """
    claimed: set[int] = {id(p) for p in whole}
    sizes = []
    for module in modules:
        own = [p for p in module.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        sizes.append(sum(p.numel() for p in own))
    target, taken, chosen = ratio * sum(sizes), 0, set()
    for module, size in zip(modules, sizes, strict=True):
        if ratio >= 1 or taken + size / 2 <= target:
            chosen.add(id(module))
            taken += size
    return chosen


def _shard(module: nn.Module, kwargs: dict, *, kept: bool) -> nn.Module:
    """``fully_shard(module)``; ``kept``: mark its sharded parameters as left on the device by partial offload
    (the offloaded optimizer steps those with torch's Adam there: ``zero/sharded_cpu_adam.py``). Gathered in a
    16-bit dtype, its gradients accumulate in fp32 between reductions, all of them (``compat``)."""

    unit = fully_shard(module, **kwargs)
    if kwargs["mp_policy"].param_dtype is not None:
        fsdp_accumulate_in_reduce_dtype(unit)
    if kept:
        for param in unit_parameters(unit):
            setattr(param, KEPT_ON_DEVICE, True)
    return unit


def unit_parameters(unit: FSDPModule) -> list[nn.Parameter]:
    """The sharded parameters an FSDP2 unit manages (not those of units nested in it)."""
    groups = fsdp_param_groups(fsdp_state(unit))
    return [fsdp_param.sharded_param for group in groups for fsdp_param in group.fsdp_params]


def shard_states(units: list[FSDPModule]) -> dict[int, Any]:
    """FSDP2's record of each sharded parameter of ``units`` (its ``FSDPParam``), by ``id`` of the parameter."""
    return {
        id(fsdp_param.sharded_param): fsdp_param
        for unit in units
        for group in fsdp_param_groups(fsdp_state(unit))
        for fsdp_param in group.fsdp_params
    }


def _shard_experts(
    root: nn.Module, experts: ExpertSharding, options: Callable[[nn.Module], tuple[dict, bool]]
) -> list[nn.Module]:
    """One unit per module holding expert weights, over their replicas; the ``ExpertShard`` marks carried
    over to FSDP2's new (DTensor) parameters, which checkpoints, clipping and the norms read."""

    units = []
    replicas = experts.mesh.size()
    for owner, marks in _expert_owners(root):
        others = [n for n, _ in owner.named_parameters(recurse=False) if n not in marks]
        if others:
            raise ValueError(
                f"ZeRO with `expert_parallel`: {type(owner).__name__} registers expert weights beside other"
                f" parameters ({', '.join(others)}); the expert weights are sharded over their replicas in a unit"
                " of their own. Keep the stacked expert weights in a module of their own (as Hugging Face's fused"
                " experts and this library's MoE do)."
            )
        placements = {
            id(owner.get_parameter(n)): expert_placement(owner.get_parameter(n), replicas) for n in marks
        }
        kwargs, kept = options(owner)
        unit = _shard(
            owner,
            {
                **kwargs,
                "mesh": experts.mesh,
                "shard_placement_fn": lambda p, placements=placements: placements[id(p)],
            },
            kept=kept,
        )
        unit.set_gradient_divide_factor(float(experts.data_parallel))
        # gloo has no pre-multiplied sum: sum, then divide. Not on one replica, where torch 2.13 skips the
        # collective and divides once itself, and the forced sum would divide a second time (measured).
        unit.set_force_sum_reduction_for_comms(experts.mesh.size() > 1)
        for name, mark in marks.items():
            setattr(owner.get_parameter(name), SHARD_ATTR, mark)
        units.append(unit)
    return units


def regather(units: list[FSDPModule]) -> None:
    """ZeRO-2 between steps: gather the updated shards, so the whole parameters stay until the next backward.

    The gathered parameters are other objects than the shards; expert marks and row layouts are carried over
    to them, so ``expert_parameters(module)`` and ``row_layout(param)`` answer alike between steps.
    """
    for unit in units:
        unit.unshard()
        for group in fsdp_param_groups(fsdp_state(unit)):
            for fsdp_param in group.fsdp_params:
                for attribute in (SHARD_ATTR, ROW_LAYOUT):
                    mark = getattr(fsdp_param.sharded_param, attribute, None)
                    if mark is not None:
                        setattr(fsdp_param.unsharded_param, attribute, mark)
