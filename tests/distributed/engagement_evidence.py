"""Measured evidence for the engagement rows that a configuration flag cannot prove (issue 33).

- **tensor parallelism**: which blocks of the model's stack hold weights sharded over ``tp`` and what
  share of the stack's matrix weights is sharded (``plans/auto.py`` may leave a block replicated with a
  note: one sharded parameter elsewhere must not make the row pass);
- **offload**: where the optimizer's states live and who stepped them: the bytes of Adam's moments held
  by a host optimizer (DeepSpeed's CPU Adam inside its engine, or ours on FSDP2's shards), the devices
  of those tensors, and the host step count. On a CPU-only machine host and device are one memory, so
  the device check only bites on a GPU; the bytes and the host steps bite everywhere;
- **ZeRO on FSDP2**: the share of optimizer-state elements sharded over a data-parallel axis (the
  reduce-scatter counts come from the collective counter, ``engagement.py``);
- **recomputation**: which policy ran is told by what backward ran again (the compute-dtype counter:
  every op, and the matrix products among them); the policy asked for is read here;
- **context parallelism after the stack**: the losses computed on each rank's tokens and the functions
  that needed the whole sequence gathered (``context_parallel/local_tokens.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

__all__ = [
    "fsdp2_sharding_problem",
    "host_optimizer_problem",
    "host_step_overlap_expected",
    "host_step_overlap_problem",
    "offload_record",
    "recomputation_problem",
    "recomputation_record",
    "context_tokens_record",
    "state_sharding_record",
    "tensor_parallel_problem",
    "tensor_parallel_record",
]

# The first ModuleList index of a parameter's name: its block in the stack ("model.layers.3.mlp.up.weight").
_BLOCK = re.compile(r"^(.*?\.\d+)\.")


def _dtensor_shard_axes(tensor: torch.Tensor) -> set[str]:
    """The mesh axes a DTensor is sharded over (empty for a plain tensor)."""
    from torch.distributed.tensor import DTensor, Shard

    from lightning_parallel.compat import StridedShard

    if not isinstance(tensor, DTensor):
        return set()
    names = tensor.device_mesh.mesh_dim_names or ()
    # A fused projection's shards are _StridedShard, no Shard on torch 2.13 (one slice of each part).
    return {
        name for name, p in zip(names, tensor.placements, strict=True) if isinstance(p, (Shard, StridedShard))
    }


def _expert_weight(name: str) -> bool:
    """An MoE expert's weight (an ``experts`` list of modules; stacked experts are 3-D and skipped by shape):
    expert parallelism's to shard, which tensor parallelism leaves whole on each of its ranks."""
    return ".experts." in name


def _block_of(name: str, stack: list[str] | None) -> str | None:
    """The block of the stack holding parameter ``name``: the plan's blocks where there is a plan (a model's
    other lists of modules, as Gemma 3n's ``altup_projections``, are not blocks), else the first list index."""
    if stack:
        return next((b for b in stack if name.startswith(b + ".")), None)
    match = _BLOCK.match(name)
    return match.group(1) if match else None


def tensor_parallel_record(
    module: nn.Module, expert_ids: set[int], stack: list[str] | None = None
) -> dict[str, Any]:
    """Blocks of the stack (by name; ``stack``: the plan's) and those with a matrix weight sharded over ``tp``;
    the stack's 2-D weights' elements (global) and those sharded. Expert weights are expert parallelism's, not
    counted."""
    from lightning_parallel.zero.tensor_parallel import user_named_parameters

    blocks: dict[str, bool] = {}
    numel = sharded = 0
    for name, param in user_named_parameters(module):
        block = _block_of(name, stack)
        if (
            block is None
            or param.is_meta
            or param.dim() != 2
            or id(param) in expert_ids
            or _expert_weight(name)
        ):
            continue
        is_sharded = "tp" in _dtensor_shard_axes(param)
        blocks[block] = blocks.get(block, False) or is_sharded
        numel += param.numel()
        sharded += param.numel() if is_sharded else 0
    return {
        "tp_blocks": sorted(blocks),
        "tp_sharded_blocks": sorted(b for b, s in blocks.items() if s),
        "tp_block_matrix_numel": numel,
        "tp_block_matrix_sharded_numel": sharded,
    }


def tensor_parallel_modes(strategy: Any) -> dict[str, Any]:
    """How the verification chose to run the plan's containers (``ShardedContainer``): the layouts of entries
    it picked among variants, and whether per-head inputs were cut to the rank's heads."""
    plan = getattr(getattr(strategy, "parallelized", None), "plan", None)
    modes: set[str] = set()
    for container in getattr(plan, "containers", ()):
        if container.variant_label:
            modes.add(container.variant_label)
        if container.slice_heads:
            modes.add("per-head inputs cut to the local heads")
        if container.inner_gathered:
            modes.add("MLP hidden units gathered")
    modes |= (
        {"modules left whole run on the whole sequence"} if getattr(plan, "whole_sequence", None) else set()
    )
    return {"tp_modes": sorted(modes)}


def _states(optimizer: Any) -> list[torch.Tensor]:
    """The tensor states (moments, buffers) of a torch-style optimizer, steps excluded."""
    out = []
    for state in getattr(optimizer, "state", {}).values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.dim() > 0:
                out.append(value)
    return out


def _host_steps(optimizer: Any) -> int:
    steps = [int(s["step"]) for s in getattr(optimizer, "state", {}).values() if "step" in s]
    return max(steps, default=0)


def _deepspeed_offload_record(engine: Any) -> dict[str, Any]:
    """DeepSpeed's engine with offload: the optimizer it runs on the host (CPU Adam, or the user's torch
    optimizer under ``zero_force_ds_cpu_optimizer=False``) steps fp32 partitions kept in host memory."""
    if not engine.zero_cpu_offload():
        return {}
    zero = engine.optimizer
    host = getattr(zero, "optimizer", None)
    parts = list(
        getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_partitioned_groups_flat", None)
        or []
    )  # fmt: skip
    tensors = parts + _states(host)
    return {
        "host_optimizer": type(host).__name__,
        "host_state_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "host_state_devices": sorted({t.device.type for t in tensors}),
        "host_steps": _host_steps(host) or int(getattr(engine, "global_steps", 0)),
    }


def offload_record(strategy: Any) -> dict[str, Any]:
    """The host optimizer's master weights and states: bytes, devices, steps (nothing without one)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    engine = getattr(strategy, "zero_engine", None)
    if engine is not None:
        return _deepspeed_offload_record(engine)
    for optimizer in getattr(strategy, "optimizers", []):
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's wrapper
        if not isinstance(optimizer, DeepSpeedCPUAdam):
            continue
        from lightning_parallel.zero.sharded_cpu_adam import offloaded

        states = [  # those the CPU kernel steps (partial offload keeps some parameters on the device)
            s
            for param, state in optimizer.state.items()
            if offloaded(param)
            for k, s in state.items()
            if k != "step" and isinstance(s, torch.Tensor) and s.dim() > 0
        ]
        return {
            "host_optimizer": type(optimizer).__name__,
            "host_state_bytes": sum(s.numel() * s.element_size() for s in states),
            "host_state_devices": sorted({s.device.type for s in states}),
            "host_steps": _host_steps(optimizer),
            **_host_step_overlap_record(getattr(strategy, "host_step", None)),
            **_importance_split_record(vars(optimizer).get("deferred_update")),
        }
    return {}


def _importance_split_record(update: Any) -> dict[str, Any]:
    """Rows the importance split updated at once and later, on this rank (``zero/importance_split.py``)."""
    if update is None or not hasattr(update, "rows_at_once"):
        return {}
    return {"rows_at_once": update.rows_at_once, "rows_deferred": update.rows_deferred}


def _host_step_overlap_record(overlap: Any) -> dict[str, Any]:
    """The host steps run during backward (``zero/overlapped_step.py``): how many over the run, and how many began
    before their backward returned (timestamps, not the strategy's decision; over every step of the run: in one
    step of a tiny model on a loaded 2-core machine the worker thread may not get a core before backward ends)."""
    if overlap is None:
        return {"host_steps_in_backward": 0, "host_steps_begun_before_backward_end": 0}
    return {
        "host_steps_in_backward": overlap.stepped_in_backward,
        "host_steps_begun_before_backward_end": overlap.begun_before_backward_end,
    }


def _dp_sharded(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """Local elements of ``tensors``, and of those sharded over a data-parallel axis (dp, or dp carved with ep
    or cp)."""
    total = sharded = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel()
        sharded += local.numel() if _dtensor_shard_axes(tensor) - {"tp", "pp"} else 0
    return total, sharded


def state_sharding_record(strategy: Any) -> dict[str, Any]:
    """Optimizer-state elements on this rank, and those sharded over a data-parallel axis (FSDP2's DTensors);
    where the states live in files (NVMe offload), the parameters the optimizer steps, whose shards they follow."""
    states: list[torch.Tensor] = []
    stepped: list[torch.Tensor] = []
    for optimizer in getattr(strategy, "optimizers", []):
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        states += _states(optimizer)
        stepped += [p for group in optimizer.param_groups for p in group["params"]]
    total, sharded = _dp_sharded(states)
    if total == 0:
        total, sharded = _dp_sharded(stepped)
    return {"state_numel": total, "state_dp_sharded_numel": sharded}


def recomputation_record(strategy: Any) -> dict[str, Any]:
    """The recomputation asked for: full, op-level selective (matmuls kept) or selective by blocks."""
    checkpointing = getattr(getattr(getattr(strategy, "config", None), "memory", None), "checkpointing", None)
    if checkpointing is None:
        return {}
    if checkpointing.ops:
        return {"recompute_policy": "ops_alternate_matmuls" if checkpointing.alternate_matmuls else "ops"}
    return {"recompute_policy": str(checkpointing.mode)}


def context_tokens_record(strategy: Any) -> dict[str, Any]:
    tokens = getattr(getattr(strategy, "parallelized", None), "context_tokens", None)
    if tokens is None:
        return {}
    return {"context_local_losses": tokens.local_losses, "context_tokens_gathered": sorted(tokens.gathered)}


def _check(condition: bool, message: str) -> str | None:
    return None if condition else message


def tensor_parallel_problem(record: dict[str, Any]) -> str | None:
    """Every block of the stack holds weights sharded over tp, and at least half its matrix elements are."""
    blocks, sharded = set(record.get("tp_blocks", [])), set(record.get("tp_sharded_blocks", []))
    if not sharded:
        return "no weight of the block stack is sharded over tp"
    if blocks - sharded:
        return f"blocks left whole on every tp rank: {sorted(blocks - sharded)}"
    whole, part = record.get("tp_block_matrix_numel", 0), record.get("tp_block_matrix_sharded_numel", 0)
    return _check(2 * part >= whole, f"{part} of the block stack's {whole} matrix elements sharded over tp")


def fsdp2_sharding_problem(record: dict[str, Any]) -> str | None:
    """ZeRO on FSDP2: gradients reduce-scattered over dp each step, most optimizer-state elements sharded."""
    if record.get("zero_engine") != "fsdp2":
        return None
    steps = max(record.get("optimizer_steps", 0), 1)
    scatters = sum(
        n for key, n in record.get("collectives", {}).items()
        if key.split(".")[0] != "tp" and "reducescatter" in key.split(".", 1)[1].replace("_", "")
    )  # fmt: skip
    total, part = record.get("state_numel", 0), record.get("state_dp_sharded_numel", 0)
    return _check(
        scatters >= steps and 0 < total <= 2 * part,
        f"{scatters} reduce-scatters in {steps} steps, {part} of {total} optimizer-state elements sharded over dp",
    )


def host_optimizer_problem(record: dict[str, Any]) -> str | None:
    """CPU offload: a host optimizer stepped every step on states that live on the host (bytes, not flags)."""
    if record.get("host_optimizer") is None:
        return "no optimizer steps master weights or states held in host memory"
    return _check(
        record.get("host_state_bytes", 0) > 0
        and record.get("host_state_devices") == ["cpu"]
        and record.get("host_steps", 0) >= record.get("optimizer_steps", 0) > 0,
        f"{record.get('host_optimizer')}: {record.get('host_state_bytes', 0)} bytes of states on"
        f" {record.get('host_state_devices')}, {record.get('host_steps', 0)} host steps for"
        f" {record.get('optimizer_steps', 0)} optimizer steps",
    )


def host_step_overlap_expected(record: dict[str, Any], trainer_kwargs: Any, strategy_kwargs: Any) -> bool:
    """Whether a case's step needs nothing global, so FSDP2's offloaded shards must be stepped during backward:
    Adam on FSDP2's host shards (not in files), no clipping, no fp16 loss scale, one reduction per step."""
    return (
        record.get("zero_engine") == "fsdp2"
        and record.get("host_optimizer") == "ShardedCPUAdam"
        and not trainer_kwargs.get("gradient_clip_val")
        and trainer_kwargs.get("precision") != "16-mixed"
        and not (
            strategy_kwargs.get("pipeline_parallel", 1) > 1
            and strategy_kwargs.get("zero_reshard") == "micro_batch"
        )
    )


def host_step_overlap_problem(record: dict[str, Any], expected: bool) -> str | None:
    """FSDP2's CPU offload where the step needs nothing global: every offloaded shard stepped during backward,
    some before it ended; elsewhere (clipping, a loss scale, another engine) none (stepping early would be wrong)."""
    during = record.get("host_steps_in_backward", 0)
    if not expected:
        return _check(during == 0, f"{during} host steps ran during backward where the step must wait for it")
    begun = record.get("host_steps_begun_before_backward_end", 0)  # every step stepped shards during backward
    return _check(
        during >= record.get("optimizer_steps", 0) > 0 and begun > 0,
        f"{during} host steps ran during backward over {record.get('optimizer_steps', 0)} optimizer steps, {begun}"
        " of them began before their backward ended",
    )


def recomputation_problem(record: dict[str, Any], asked: str) -> str | None:
    """Full recomputation runs every matmul of a block again in backward; op-level selective recomputation
    runs cheap ops again but keeps every matmul (selective by blocks recomputes those blocks fully)."""
    if record.get("checkpointed_modules", 0) == 0:
        return "no module recomputes its forward"
    ops, matmuls = record.get("recomputed_ops", 0), record.get("recomputed_matmuls", 0)
    if asked == "full" or record.get("recompute_policy") != "ops":
        return _check(matmuls > 0, f"backward ran {ops} ops again, no matrix product among them")
    return _check(
        ops > 0 and matmuls == 0, f"backward ran {ops} ops again, {matmuls} matrix products among them (kept)"
    )
