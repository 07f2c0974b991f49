"""Proof that each feature a parity case asks for really ran: a record taken from the trained module.

Identical numbers prove nothing when a feature silently did nothing (checkpointing never
recomputed, ZeRO never sharded, a schedule fell back to another): the run would match the
single process all the same. So the worker takes, on every rank after training, what can only
be there if the feature ran (:func:`rank_record`: the placements of the parameters, the ZeRO
engine and its stage, the pipeline schedule's class, the recomputed modules, the optimizer that
steps the offloaded states and the bytes its files moved, the dtypes and autocast state the
forward saw); rank 0 merges them (:func:`merge_records`), and :func:`engagement_problems` checks
every row of ``tests.compat.case_features(case)`` against the record. A row without a check is a
problem too, so the compatibility matrix, which counts cells from the same rows, can only count
a cell whose case showed both of its features engaged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed.engagement_evidence import (
    context_tokens_record,
    fsdp2_sharding_problem,
    host_optimizer_problem,
    host_step_overlap_problem,
    offload_record,
    recomputation_problem,
    recomputation_record,
    state_sharding_record,
    tensor_parallel_modes,
    tensor_parallel_problem,
    tensor_parallel_record,
)

__all__ = [
    "CollectiveCounter",
    "ForwardProbe",
    "engagement_problems",
    "merge_records",
    "mesh_axes",
    "rank_record",
]

# What the schedule rows name, as torch's classes.
SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


class ForwardProbe:
    """Forward hooks on the model's norms and linears, counting what the forward really saw."""

    def __init__(self, module: nn.Module) -> None:
        self.counts = {"sequence_sharded_norm_inputs": 0, "autocast_linears": 0, "linears": 0}
        self.handles = []
        norms = [sub for sub in module.modules() if "norm" in type(sub).__name__.lower()]
        # every norm without weights: nothing for sequence parallelism to turn into a DTensor
        self.counts["weightless_norms"] = int(
            bool(norms) and not any(True for n in norms for _ in n.parameters())
        )
        self.counts["norms"] = len(norms)
        for sub in module.modules():
            if "norm" in type(sub).__name__.lower():
                self.handles.append(sub.register_forward_pre_hook(self._norm))
            elif isinstance(sub, nn.Linear) or type(sub).__name__ == "Conv1D":
                self.handles.append(sub.register_forward_pre_hook(self._linear))

    def _norm(self, module: nn.Module, args: tuple) -> None:
        from torch.distributed.tensor import DTensor, Shard

        x = args[0] if args else None
        if isinstance(x, DTensor) and any(isinstance(p, Shard) and p.dim == 1 for p in x.placements):
            self.counts["sequence_sharded_norm_inputs"] += 1

    def _linear(self, module: nn.Module, args: tuple) -> None:
        self.counts["linears"] += 1
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type):
            self.counts["autocast_linears"] += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# The torch.ops namespaces of collectives: c10d (torch.distributed's calls, DDP's reducer, FSDP2,
# DeepSpeed, the pipeline's send/recv) and the functional collectives (DTensor's redistributions).
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})
NOT_COLLECTIVES = frozenset({"wait_tensor", "barrier", "monitored_barrier_"})


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives a training step issues, by operation and by the ranks of their group.

    A dispatch mode sees every operator call, and every collective is one (torch's ProcessGroup
    methods go through the dispatcher, so DDP's C++ reducer is seen too). DTensor is let run first
    (``NotImplemented``), so its redistributions come back here as the functional collectives
    they issue. Only this thread: work chained on a collective's
    future (PowerSGD's second all-reduce) runs on the backend's thread and is not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[tuple[int, ...], str]] = Counter()
        # the dtype each all-gather carried (ZeRO's parameter gathers: ``zero_gather_dtype``)
        self.gathered: Counter[tuple[tuple[int, ...], str]] = Counter()
        self._ranks: dict[object, tuple[int, ...]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        self.observe(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))

    def observe(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Count ``func`` if it is a collective (also called by another mode that carries this count:
        the harness's ``ComputeDtypeCounter``, one dispatch mode for both records)."""
        if func.namespace in COLLECTIVE_NAMESPACES:
            name = func.__name__.split(".")[0]
            if name not in NOT_COLLECTIVES:
                ranks = self._group_ranks(func, args, kwargs)
                self.counts[(ranks, name)] += 1
                if _kind(name) == "gather":
                    self.gathered[(ranks, _first_tensor_dtype(args, kwargs))] += 1

    def _group_ranks(self, func: Any, args: tuple, kwargs: dict) -> tuple[int, ...]:
        import torch.distributed as dist

        for i, spec in enumerate(func._schema.arguments):
            arg = args[i] if i < len(args) else kwargs.get(spec.name)
            if spec.name == "group_name" and isinstance(arg, str):  # functional collectives
                key: object = arg
            elif isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
                key = arg
            else:
                continue
            if key not in self._ranks:
                group = (
                    torch._C._distributed_c10d._resolve_process_group(arg)
                    if isinstance(arg, str)
                    else torch._C._distributed_c10d.ProcessGroup.unbox(arg)
                )
                self._ranks[key] = tuple(sorted(dist.get_process_group_ranks(group)))
            return self._ranks[key]
        return ()

    def by_axis(self, axes: dict[str, tuple[int, ...]]) -> dict[str, int]:
        """``{"axis.op": count}``: each group named by every axis whose ranks it holds (else its ranks)."""
        return _named(self.counts, axes)

    def gathers_by_axis(self, axes: dict[str, tuple[int, ...]]) -> dict[str, int]:
        """``{"axis.dtype": count}`` of the all-gathers, named as :meth:`by_axis` names them."""
        return _named(self.gathered, axes)


def _named(counts: Counter[tuple[tuple[int, ...], str]], axes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    named: Counter[str] = Counter()
    for (ranks, what), count in counts.items():
        labels = [axis for axis, members in axes.items() if members == ranks] or [f"ranks{list(ranks)}"]
        for label in labels:
            named[f"{label}.{what}"] += count
    return dict(named)


def _first_tensor_dtype(args: tuple, kwargs: dict) -> str:
    """The dtype of a collective's first tensor argument (its output or input buffer: alike for a gather)."""
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                return str(item.dtype).removeprefix("torch.")
    return "none"


def mesh_axes(strategy: Any) -> dict[str, tuple[int, ...]]:
    """This rank's group on each parallel axis of more than one rank: the strategy's mesh, or the world (DDP)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is None or getattr(strategy, "dims", None) is None:
        world = tuple(range(dist.get_world_size()))
        return {"dp": world} if len(world) > 1 else {}
    axes = {}
    for name in ("pp", "dp", "tp", "ep", "cp", "dp_replicate", "dp_batch"):
        try:
            sub = mesh[name]
        except (KeyError, RuntimeError, ValueError):
            continue
        if sub.size() > 1:
            axes[name] = tuple(sorted(dist.get_process_group_ranks(sub.get_group())))
    return axes


def _placements(module: nn.Module) -> dict[str, int]:
    from torch.distributed.tensor import DTensor, Shard

    from lightning_parallel.compat import StridedShard
    from lightning_parallel.zero.tensor_parallel import user_named_parameters

    counts = {"tp_sharded_parameters": 0, "dp_sharded_parameters": 0}
    for _, param in user_named_parameters(module):
        if not isinstance(param, DTensor):
            continue
        names = param.device_mesh.mesh_dim_names or ()
        for name, placement in zip(names, param.placements, strict=True):
            if isinstance(placement, (Shard, StridedShard)):
                key = "tp_sharded_parameters" if name == "tp" else "dp_sharded_parameters"
                counts[key] += 1
    return counts


def _local_numel(param: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if hasattr(param, "ds_numel"):  # DeepSpeed ZeRO-3: the full size of a partitioned parameter
        return int(param.ds_numel)
    return int(param.to_local().numel() if isinstance(param, DTensor) else param.numel())


def _zero(strategy: Any, module: nn.Module, placements: dict[str, int]) -> dict[str, Any]:
    record: dict[str, Any] = {"zero_stage": 0}
    engine = getattr(strategy, "zero_engine", None)
    if engine is not None:
        record["zero_stage"] = int(engine.zero_optimization_stage())
        record["zero_engine"] = "deepspeed"
        # The fp32 partitions this rank's optimizer steps, against the parameters it would hold whole.
        optimizer = engine.optimizer
        parts = getattr(optimizer, "single_partition_of_fp32_groups", None) or getattr(
            optimizer, "fp32_partitioned_groups_flat", None
        )
        # stage 3 counts its partitions apart: a partition swapped to NVMe is an empty tensor in memory
        swapped_aware = getattr(optimizer, "fp16_partitioned_groups_flat_numel", None)
        record["zero_partition_numel"] = (
            sum(int(n) for n in swapped_aware) if swapped_aware else sum(int(p.numel()) for p in parts or [])
        )
        record["parameter_numel"] = sum(_local_numel(p) for p in module.parameters() if not p.is_meta)
        if engine.zero_nvme_offload_optimizer():
            record["offload"] = "nvme"
            # what DeepSpeed's swapper holds in its files now (the fp32 partitions and their optimizer states)
            swapper = getattr(optimizer, "optimizer_swapper", None)
            folder = Path(swapper.swap_folder) if swapper is not None else None
            files = (
                [f for f in folder.iterdir() if f.is_file()] if folder is not None and folder.is_dir() else []
            )
            record["nvme_bytes_written"] = sum(f.stat().st_size for f in files)
        elif engine.zero_cpu_offload():
            record["offload"] = "cpu"
        return record
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        # FSDP2 (zero/fsdp.py): ZeRO-3 leaves the parameters sharded over dp between steps; ZeRO-2
        # gathers them again after the optimizer step (whole between steps, docs/zero.md).
        record["zero_engine"] = "fsdp2"
        record["zero_stage"] = 3 if placements["dp_sharded_parameters"] else 2
    for optimizer in getattr(strategy, "optimizers", []):
        kind = type(optimizer).__name__
        if kind == "ShardedNVMeAdam":
            record["offload"] = "nvme"
            record["nvme_bytes_written"] = int(optimizer.files.bytes_written)
        elif kind == "ShardedCPUAdam":
            record["offload"] = "cpu"
    return record


def _stored_parameters(strategy: Any, module: nn.Module) -> list[torch.Tensor]:
    """The parameters as the optimizer keeps them: on FSDP2, the shards its optimizer steps (between steps ZeRO-2's
    module holds gathered copies, in the compute dtype under ``zero_gather_dtype="compute"``), else the module's."""
    from torch.distributed.fsdp import FSDPModule

    optimizers = getattr(strategy, "optimizers", [])
    if not optimizers or not any(isinstance(m, FSDPModule) for m in module.modules()):
        return list(module.parameters())
    return [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]


def rank_record(
    strategy: Any,
    module: nn.Module,
    probe: ForwardProbe | None,
    collectives: CollectiveCounter | None = None,
    optimizer_steps: int = 0,
) -> dict[str, Any]:
    """This rank's evidence (see the module docstring)."""
    from lightning_parallel.memory.checkpointing import is_checkpointed

    parallelized = getattr(strategy, "parallelized", None)
    pipeline = getattr(parallelized, "pipeline", None)
    experts = getattr(parallelized, "experts", None)
    floating = {str(p.dtype) for p in _stored_parameters(strategy, module) if p.is_floating_point()}
    placements = _placements(module)
    record: dict[str, Any] = {
        **placements,
        **_zero(strategy, module, placements),
        "schedule": type(pipeline.schedule).__name__ if pipeline is not None else None,
        "checkpointed_modules": sum(is_checkpointed(m) for m in module.modules()),
        "expert_parameters": len(getattr(experts, "parameter_ids", ()) or ()),
        "parameter_dtypes": sorted(floating),
        "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in module.modules()),
        **(probe.counts if probe is not None else {}),
        "collectives": collectives.by_axis(mesh_axes(strategy)) if collectives is not None else {},
        "gather_dtypes": collectives.gathers_by_axis(mesh_axes(strategy)) if collectives is not None else {},
        "optimizer_steps": optimizer_steps,
        **tensor_parallel_record(
            module,
            set(getattr(experts, "parameter_ids", ()) or ()),
            getattr(getattr(parallelized, "plan", None), "block_names", None),
        ),
        **tensor_parallel_modes(strategy),
        **offload_record(strategy),
        **state_sharding_record(strategy),
        **recomputation_record(strategy),
        **context_tokens_record(strategy),
    }
    return record


COUNTS = {
    "tp_sharded_parameters", "dp_sharded_parameters", "checkpointed_modules", "expert_parameters",
    "sequence_sharded_norm_inputs", "autocast_linears", "linears", "nvme_bytes_written", "float8_linears",
    "recomputed_ops", "recomputed_matmuls", "tp_block_matrix_numel", "tp_block_matrix_sharded_numel",
    "host_state_bytes", "state_numel", "state_dp_sharded_numel", "rows_at_once", "rows_deferred",
    "context_local_losses",
}  # fmt: skip
# What every rank must show: the run's record keeps the least of them.
MINIMA = {"host_steps_in_backward", "host_steps_begun_before_backward_end"}


def merge_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for the run: counts summed over the ranks, minima the least, lists united, the rest from any
    rank that has it."""
    merged: dict[str, Any] = {}
    for record in records:
        for key, value in record.items():
            if key in MINIMA:
                merged[key] = min(merged.get(key, value), value)
            elif key in COUNTS:
                merged[key] = merged.get(key, 0) + value
            elif isinstance(value, dict):  # collectives per axis: the busiest rank's count
                mine = merged.setdefault(key, {})
                for name, count in value.items():
                    mine[name] = max(mine.get(name, 0), count)
            elif isinstance(value, list):
                merged[key] = sorted(set(merged.get(key, [])) | set(value))
            else:
                merged[key] = merged.get(key) or value
    return merged


def _check(condition: bool, message: str) -> str | None:
    return None if condition else message


def _schedule_check(cls: str) -> Callable[[dict[str, Any], dict[str, Any]], str | None]:
    return lambda r, f: _check(r.get("schedule") == cls, f"schedule {r.get('schedule')} ran, not {cls}")


def _sequence_parallel_problem(record: dict[str, Any]) -> str | None:
    """A norm with weights saw a sequence-sharded DTensor; a model whose norms have none (OLMo's) or that has
    no norm at all runs on plain local slices, so there the row-parallel exits' reduce-scatters over tp are
    the evidence."""
    scatters = sum(n for k, n in record.get("collectives", {}).items() if k.startswith("tp.reduce_scatter"))
    normless = record.get("weightless_norms") or record.get("norms", 1) == 0
    if record.get("sequence_sharded_norm_inputs", 0) > 0 or (normless and scatters > 0):
        return None
    return "no norm saw a sequence-sharded input"


def gather_dtype_problem(record: dict[str, Any], expected: str | None) -> str | None:
    """``zero_gather_dtype="compute"``: every all-gather over dp carried the autocast dtype, at least one a step."""
    dp = {
        key.split(".", 1)[1]: n
        for key, n in record.get("gather_dtypes", {}).items()
        if key.split(".")[0] == "dp"
    }
    steps = record.get("optimizer_steps", 0)
    return _check(
        expected is not None and set(dp) == {expected} and dp[expected] >= steps > 0,
        f"the dp all-gathers carried {dp} in {steps} steps, not {expected} alone",
    )


def _partition_problem(record: dict[str, Any]) -> str | None:
    """DeepSpeed's engine: this rank's optimizer steps a partition, not every parameter."""
    if record.get("zero_engine") != "deepspeed":
        return None
    part, whole = record.get("zero_partition_numel", 0), record.get("parameter_numel", 0)
    return _check(0 < part < whole, f"the rank's fp32 partition holds {part} of {whole} parameter elements")


CHECKS: dict[str, Callable[[dict[str, Any], dict[str, Any]], str | None]] = {
    "dp": lambda r, f: _check(f.get("data_parallel", 0) > 1, "the sampler did not split the data"),
    "tp": lambda r, f: tensor_parallel_problem(r),
    "sp": lambda r, f: _sequence_parallel_problem(r),
    "ep": lambda r, f: _check(r.get("expert_parameters", 0) > 0, "no expert weight was sharded over ep"),
    "cp": lambda r, f: _check(f.get("context_calls", 0) > 0, "no attention call went over the context split"),
    "zero1": lambda r, f: (
        _check(r.get("zero_stage") == 1, f"ZeRO stage {r.get('zero_stage')} ran, not 1")
        or _partition_problem(r)
    ),
    "zero2": lambda r, f: (
        _check(r.get("zero_stage") == 2, f"ZeRO stage {r.get('zero_stage')} ran, not 2")
        or _partition_problem(r)
        or fsdp2_sharding_problem(r)
    ),
    "zero3": lambda r, f: (
        _check(
            r.get("zero_stage") == 3
            and (r.get("zero_engine") == "deepspeed" or r.get("dp_sharded_parameters", 0) > 0)
            and _partition_problem(r) is None,
            f"ZeRO stage {r.get('zero_stage')} ran (engine {r.get('zero_engine')}), not 3 with sharded parameters",
        )
        or fsdp2_sharding_problem(r)
    ),
    "offload=cpu": lambda r, f: (
        _check(r.get("offload") == "cpu", f"offload {r.get('offload')!r} ran, not 'cpu'")
        or host_optimizer_problem(r)
        or host_step_overlap_problem(r, bool(f.get("host_step_overlap_expected")))
    ),
    "offload=nvme": lambda r, f: _check(
        r.get("offload") == "nvme" and r.get("nvme_bytes_written", 0) > 0,
        f"offload {r.get('offload')!r} ran ({r.get('nvme_bytes_written', 0)} bytes written), not 'nvme'",
    ),
    # an option of ZeRO-2/3 on FSDP2, not a row of the matrix (tests/distributed/worker.py adds it)
    "gather=compute": lambda r, f: gather_dtype_problem(r, f.get("autocast_dtype")),
    "ac=full": lambda r, f: recomputation_problem(r, "full"),
    "ac=selective": lambda r, f: recomputation_problem(r, "selective"),
    "32-true": lambda r, f: _check(
        r.get("parameter_dtypes") == ["torch.float32"] and r.get("autocast_linears", 0) == 0,
        f"parameters {r.get('parameter_dtypes')}, {r.get('autocast_linears', 0)} linears under autocast",
    ),
    "bf16-mixed": lambda r, f: _check(
        r.get("autocast_linears", 0) > 0 and "torch.float32" in r.get("parameter_dtypes", []),
        f"{r.get('autocast_linears', 0)} linears under autocast, parameters {r.get('parameter_dtypes')}",
    ),
    "16-mixed": lambda r, f: _check(
        r.get("autocast_linears", 0) > 0 and "torch.float32" in r.get("parameter_dtypes", []),
        f"{r.get('autocast_linears', 0)} linears under autocast, parameters {r.get('parameter_dtypes')}",
    ),
    "bf16-true": lambda r, f: _check(
        "torch.bfloat16" in r.get("parameter_dtypes", []), f"parameters {r.get('parameter_dtypes')}, no bf16"
    ),
    "16-true": lambda r, f: _check(
        "torch.float16" in r.get("parameter_dtypes", []), f"parameters {r.get('parameter_dtypes')}, no fp16"
    ),
    "fp8": lambda r, f: _check(
        r.get("float8_linears", 0) > 0 and r.get("autocast_linears", 0) > 0,
        f"{r.get('float8_linears', 0)} float8 linears, {r.get('autocast_linears', 0)} linears under autocast",
    ),
    **{f"pp={name}": _schedule_check(cls) for name, cls in SCHEDULE_CLASSES.items()},
}


def _kind(op: str) -> str:
    """The class of a collective operator's name (c10d's ``allreduce_``, functional ``all_reduce``, ...)."""
    flat = op.replace("_", "")
    if "allreduce" in flat or "reducescatter" in flat:
        return "reduction"
    if "allgather" in flat:
        return "gather"
    if "alltoall" in flat:
        return "all_to_all"
    if flat in {"send", "recv", "recvanysource"}:
        return "p2p"
    return "other"


# Per matrix row: the axis whose group must carry collectives of this kind on every optimizer step.
COLLECTIVES_PER_STEP: dict[str, tuple[str, str | None]] = {
    "dp": ("dp", "reduction"),  # the gradient average (or reduce-scatter), or over its factors:
    "tp": ("tp", None),  # any: the partial sums and gathers of sharded layers
    "sp": ("tp", "gather"),  # the sequence-sharded activations gathered before the sharded matmuls
    "cp": ("cp", None),  # ring passes or all-to-alls through attention
    "ep": ("ep", "all_to_all"),  # the token dispatch
    "zero3": ("dp", "gather"),  # parameters gathered from their shards
    **{f"pp={name}": ("pp", "p2p") for name in SCHEDULE_CLASSES},  # activations between stages
}


def collectives_per_step(record: dict[str, Any], axis: str, kind: str | None) -> float:
    """Collectives of ``kind`` (None: any) on ``axis``'s group per optimizer step, the busiest rank's."""
    steps = record.get("optimizer_steps", 0)
    if not steps:
        return 0.0
    total = sum(
        count
        for key, count in record.get("collectives", {}).items()
        if key.split(".")[0] == axis and (kind is None or _kind(key.split(".", 1)[1]) == kind)
    )
    return total / steps


# dp carved into dp_replicate x ep (or dp_batch x cp) may be reduced in two stages, one per factor.
DP_FACTORS = (("dp_replicate", "ep"), ("dp_batch", "cp"))


def _collective_problem(row: str, record: dict[str, Any]) -> str | None:
    if row not in COLLECTIVES_PER_STEP:
        return None
    axis, kind = COLLECTIVES_PER_STEP[row]
    per_step = collectives_per_step(record, axis, kind)
    if row == "dp" and any(
        all(collectives_per_step(record, factor, kind) >= 1 for factor in factors) for factors in DP_FACTORS
    ):
        return None
    return _check(
        per_step >= 1,
        f"{per_step:.3g} {kind or 'collective'}(s) per optimizer step on the {axis} group, not at least one"
        f" (issued: {record.get('collectives', {})}, {record.get('optimizer_steps', 0)} steps)",
    )


def engagement_problems(rows: frozenset[str], record: dict[str, Any], facts: dict[str, Any]) -> list[str]:
    """The rows a case asks for that its record does not show (a row without a check counts as one)."""
    problems = []
    for row in sorted(rows):
        check = CHECKS.get(row)
        if check is None:
            problems.append(
                f"{row}: no engagement check exists for this row (tests/distributed/engagement.py)"
            )
            continue
        problem = check(record, facts) or _collective_problem(row, record)
        if problem:
            problems.append(f"{row}: {problem} (record {record})")
    return problems
