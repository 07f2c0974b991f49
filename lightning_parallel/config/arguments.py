"""Each argument of the strategy alone: checked (``ValueError`` naming the argument, the value and the fix) and resolved.

Called by ``config/validation.py``, which also refuses the combinations; the two modules are the
one place where the strategy's arguments are checked (split in two only to stay readable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_parallel.comm.compression import CASTS, GradientCompression, PowerSGD
from lightning_parallel.config.parallel_config import ContextParallelConfig, ExpertConfig, MemorySaverConfig
from lightning_parallel.memory.checkpointing import CheckpointingConfig
from lightning_parallel.memory.saved_tensors import COMPRESSIONS
from lightning_parallel.pipeline.schedules import ALIASES, DEFAULT_SCHEDULE, SCHEDULES, ScheduleSpec
from lightning_parallel.pipeline.setup import PipelineConfig
from lightning_parallel.tensor_parallel.plan import ParallelPlan
from lightning_parallel.zero.arguments import OWNED_KEYS, ImportanceSplit, ZeroArguments

WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def tensor_parallel(value: Any) -> None:
    if value != "auto" and (not isinstance(value, int) or value < 1):
        raise ValueError(f"`tensor_parallel={value!r}` must be a positive integer or 'auto'.")


def loss_parallel(value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(
            f"`loss_parallel={value!r}` must be None (the default: F.cross_entropy on the logits of a sharded"
            " output head runs on the vocabulary shards, any other use of them sees them gathered), False (always"
            " gather the logits) or True (the logits stay a DTensor through the whole training step)."
        )


def plan(value: Any) -> None:
    if not (value == "auto" or isinstance(value, (dict, ParallelPlan))):
        raise ValueError(
            f"`plan={value!r}` must be 'auto', a dict of module-name patterns, or a ParallelPlan."
        )


def experts(expert_parallel: Any, aux_loss_coef: Any, z_loss_coef: Any) -> ExpertConfig:
    if not isinstance(expert_parallel, int) or expert_parallel < 1:
        raise ValueError(f"`expert_parallel={expert_parallel!r}` must be a positive integer.")
    if aux_loss_coef is not None and (not isinstance(aux_loss_coef, (int, float)) or aux_loss_coef < 0):
        raise ValueError(
            f"`moe_aux_loss_coef={aux_loss_coef!r}` must be a non-negative number or None (off)."
        )
    if not isinstance(z_loss_coef, (int, float)) or z_loss_coef < 0:
        raise ValueError(f"`moe_z_loss_coef={z_loss_coef!r}` must be a non-negative number.")
    return ExpertConfig(expert_parallel, aux_loss_coef, z_loss_coef)


CONTEXT_MODES = ("ring", "ulysses")


def context_parallel(degree: Any, mode: Any) -> ContextParallelConfig:
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(f"`context_parallel={degree!r}` must be a positive integer (1: off).")
    if mode not in CONTEXT_MODES:
        raise ValueError(
            f"`context_parallel_mode={mode!r}` must be one of {CONTEXT_MODES}: 'ring' rotates keys and values"
            " around the context ranks (any head count), 'ulysses' switches to a head split for attention by"
            " all-to-all (the heads must divide context_parallel)."
        )
    return ContextParallelConfig(degree, mode)


def init_weights(init_weights: Any) -> Path | None:
    if init_weights is None:
        return None
    if not isinstance(init_weights, (str, os.PathLike)):
        raise ValueError(
            f"`init_weights={init_weights!r}` must be the path of a state-dict file (`.safetensors`, `.pt`, `.bin`)."
        )
    path = Path(init_weights)
    if path.suffix not in WEIGHT_SUFFIXES or not path.is_file():
        raise ValueError(
            f"`init_weights={str(path)!r}` must be an existing single-file state dict ({', '.join(WEIGHT_SUFFIXES)})."
            " Write one with `safetensors.torch.save_file(module.state_dict(), path)`, `torch.save(...)` or"
            " `python -m lightning_parallel export CHECKPOINT OUT.safetensors`; to resume a run pass the checkpoint"
            " to `Trainer.fit(ckpt_path=...)` instead."
        )
    return path


def zero(
    stage: Any,
    offload: Any,
    offload_path: Any,
    deepspeed_config: Mapping[str, Any] | None,
    offload_ratio: Any = 1.0,
    reshard: Any = "step",
    engine: Any = "auto",
    update: Any = "exact",
    gather_dtype: Any = "stored",
) -> ZeroArguments:
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(
            f"`zero_stage={stage!r}` must be 0 (off), 1 (optimizer states sharded), 2 (+ gradients) or"
            " 3 (+ parameters)."
        )
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"`offload={offload!r}` must be None, 'cpu' or 'nvme'.")
    if offload is not None and stage == 0:
        raise ValueError(
            f"`offload={offload!r}` needs ZeRO: offloading moves ZeRO's optimizer partitions. Set"
            " `zero_stage=1`, 2 or 3 (3 also offloads the parameters)."
        )
    if offload == "nvme":
        if stage == 1:
            raise ValueError(
                "`offload='nvme'` with `zero_stage=1`: ZeRO-1 runs on DeepSpeed's stage-1 optimizer, which swaps"
                " nothing to NVMe (its offload is to the CPU only), and the FSDP2 engine that swaps Adam's states"
                " to NVMe shards gradients too, which is stage 2. Set `zero_stage=2` or 3, or use `offload='cpu'`."
            )
        if offload_path is None:
            raise ValueError(
                "`offload='nvme'` needs `offload_path=`: a folder on a fast local disk for the swapped"
                " parameters and optimizer states."
            )
    elif offload_path is not None:
        raise ValueError(
            f"`offload_path={str(offload_path)!r}` is only used with `offload='nvme'`; remove it or set"
            " `offload='nvme'`."
        )
    _check_offload_ratio(offload_ratio, offload, stage)
    raw = dict(deepspeed_config or {})
    if raw and stage == 0:
        raise ValueError("`deepspeed_config=` is only used with ZeRO: set `zero_stage=1`, 2 or 3.")
    for key, owner in OWNED_KEYS.items():
        if key in raw:
            raise ValueError(
                f"`deepspeed_config` sets {key!r}, which Lightning owns here: use {owner} instead, so the"
                " Trainer and DeepSpeed cannot disagree."
            )
    stage_in_raw = raw.get("zero_optimization", {}).get("stage")
    if stage_in_raw is not None and stage_in_raw != stage:
        raise ValueError(
            f"`deepspeed_config['zero_optimization']['stage']={stage_in_raw}` contradicts"
            f" `zero_stage={stage}`; set the stage with `zero_stage` only."
        )
    path = None if offload_path is None else str(offload_path)
    _check_reshard(reshard, stage)
    if engine not in ("auto", "deepspeed", "fsdp2"):
        raise ValueError(
            f"`zero_engine={engine!r}` must be 'auto' (chosen by layout), 'deepspeed' or 'fsdp2' (torch's fully_shard)."
        )
    if engine != "auto" and stage == 0:
        raise ValueError(
            f"`zero_engine={engine!r}` needs ZeRO: set `zero_stage=1`, 2 or 3, or leave it 'auto'."
        )
    if engine == "fsdp2" and (stage == 1 or raw):
        what = "`zero_stage=1` (FSDP2 shards gradients too: stage 2)" if stage == 1 else "`deepspeed_config`"
        raise ValueError(f"`zero_engine='fsdp2'` with {what}: use `zero_engine='auto'` or 'deepspeed'.")
    _check_offload_update(update, offload, stage, engine)
    return ZeroArguments(
        stage, offload, path, raw, float(offload_ratio), reshard, engine, update, gather_dtype
    )


def _check_offload_update(update: Any, offload: Any, stage: int, engine: Any) -> None:
    """``offload_update``: when the host step of offloaded shards lands (``zero/delayed_update.py``,
    ``zero/importance_split.py``)."""
    if update not in ("exact", "delayed") and not isinstance(update, ImportanceSplit):
        raise ValueError(
            f"`offload_update={update!r}` must be 'exact' (the default: the one-process run's update), 'delayed'"
            " (ZeRO-Offload's delayed parameter update: step i's host step runs during step i+1, which computes"
            " with the parameters before step i's update) or an `ImportanceSplit(top_rows=..., update_interval=...)`"
            " (the rows with the largest gradients at once, the others every few steps in the background)."
        )
    if update == "exact":
        return
    if offload != "cpu" or stage == 1 or engine == "deepspeed":
        what = (
            f"`offload={offload!r}`"
            if offload != "cpu"
            else "`zero_stage=1`"
            if stage == 1
            else "`zero_engine='deepspeed'`"
        )
        raise ValueError(
            f"`offload_update={update!r}` with {what}: that update runs on FSDP2's engine, stepping its"
            " shards in host memory (`offload='cpu'`, `zero_stage=2` or 3). Set those, or leave"
            " `offload_update='exact'`."
        )


def _check_reshard(reshard: Any, stage: int) -> None:
    """``zero_reshard``: when FSDP2 units under pipeline stages give back their gathered memory."""
    if reshard not in ("step", "micro_batch"):
        raise ValueError(
            f"`zero_reshard={reshard!r}` must be 'step' (gather once per step under pipeline stages, the default)"
            " or 'micro_batch' (reduce-scatter gradients and reshard parameters after every micro-batch)."
        )
    if reshard == "micro_batch" and stage < 2:
        raise ValueError(
            f"`zero_reshard='micro_batch'` with `zero_stage={stage}`: only stages 2 (sharded gradients) and 3"
            " (sharded parameters too) have something to give back between micro-batches. Set `zero_stage=2`"
            " or 3, or leave `zero_reshard='step'`."
        )


def _check_offload_ratio(ratio: Any, offload: Any, stage: int) -> None:
    """``offload_ratio``: the fraction of the optimizer offloaded (DeepSpeed's Twin-Flow ``ratio``)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(
            f"`offload_ratio={ratio!r}` must be a number in (0, 1]: the fraction of the parameters whose optimizer"
            " states and step are offloaded (1: all, the default). For none, leave `offload=None`."
        )
    if ratio == 1:
        return
    if offload is None:
        raise ValueError(
            f"`offload_ratio={ratio}` needs `offload='cpu'` or 'nvme': it says how much to offload."
        )
    if stage == 1:
        raise ValueError(
            f"`offload_ratio={ratio}` with `zero_stage=1`: partial offload runs on the FSDP2 engine, one offload"
            " policy per FSDP2 unit, and FSDP2 shards gradients too (stage 2); DeepSpeed's stage-1 optimizer"
            " offloads all or nothing. Set `zero_stage=2` or 3, or `offload_ratio=1`."
        )


def resolve_schedule(name: str | None) -> ScheduleSpec:
    """The spec for a user's schedule string; a clear ``ValueError`` for an unknown one."""
    key = (name or DEFAULT_SCHEDULE).lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(
            f"`pipeline_schedule={name!r}` is not a known schedule. Choose one of"
            f" {', '.join(repr(n) for n in SCHEDULES)} (aliases: {', '.join(repr(a) for a in ALIASES)})."
        )
    return SCHEDULES[key]


def virtual_stages_for(spec: ScheduleSpec, requested: int | None) -> int:
    """Stages per rank: 1 for single-stage schedules, 2 (or ``requested``) for the others."""
    if spec.fixed_virtual_stages is not None:
        if requested not in (None, spec.fixed_virtual_stages):
            raise ValueError(
                f"`pipeline_virtual_stages={requested}`: the {spec.name!r} schedule places exactly"
                f" {spec.fixed_virtual_stages} stages on each rank. Leave `pipeline_virtual_stages` unset."
            )
        return spec.fixed_virtual_stages
    if not spec.multi_stage:
        if requested not in (None, 1):
            raise ValueError(
                f"`pipeline_virtual_stages={requested}`: the {spec.name!r} schedule holds one stage per rank."
                " Use 'interleaved_1f1b', 'looped_bfs' or 'interleaved_zero_bubble' for several stages per rank."
            )
        return 1
    value = 2 if requested is None else requested
    if not isinstance(value, int) or value < 2:
        raise ValueError(
            f"`pipeline_virtual_stages={requested!r}`: the {spec.name!r} schedule needs at least 2 stages per rank."
        )
    return value


def check_micro_batches(spec: ScheduleSpec, micro_batches: int, pipeline_parallel: int) -> None:
    """Refuse micro-batch counts the schedule cannot run (torch would fail or hang mid-step)."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"`micro_batches={micro_batches!r}` must be a positive integer.")
    p = pipeline_parallel
    if spec.name == "interleaved_1f1b" and micro_batches % p:
        raise ValueError(
            f"`micro_batches={micro_batches}`: the 'interleaved_1f1b' schedule needs a multiple of"
            f" `pipeline_parallel={p}` micro-batches. Use {-(-micro_batches // p) * p}."
        )
    if spec.name == "1f1b" and micro_batches < p:
        raise ValueError(
            f"`micro_batches={micro_batches}`: the '1f1b' schedule needs at least `pipeline_parallel="
            f"{p}` micro-batches (one in flight per stage). Use 'gpipe' for fewer."
        )
    if spec.placement in ("loop", "v") and micro_batches < p:
        raise ValueError(
            f"`micro_batches={micro_batches}`: the {spec.name!r} schedule needs at least"
            f" `pipeline_parallel={p}` micro-batches to fill the pipeline."
        )
    if spec.name == "dualpipev" and micro_batches < 2 * p:
        raise ValueError(
            f"`micro_batches={micro_batches}`: the 'dualpipev' schedule needs at least 2 x"
            f" `pipeline_parallel` = {2 * p} micro-batches."
        )


def pipeline(
    pipeline_parallel: Any, micro_batches: Any, schedule: Any, virtual_stages: Any, boundaries: Any
) -> PipelineConfig | None:
    if not isinstance(pipeline_parallel, int) or pipeline_parallel < 1:
        raise ValueError(f"`pipeline_parallel={pipeline_parallel!r}` must be a positive integer.")
    if pipeline_parallel == 1:
        for name, value in (
            ("micro_batches", micro_batches),
            ("pipeline_schedule", schedule),
            ("pipeline_virtual_stages", virtual_stages),
        ):
            if value is not None:
                raise ValueError(
                    f"`{name}={value!r}` needs `pipeline_parallel` > 1. Without pipeline stages there is"
                    " nothing to schedule; for gradient accumulation use `Trainer(accumulate_grad_batches=...)`."
                )
        return None
    spec = resolve_schedule(schedule)
    virtual = virtual_stages_for(spec, virtual_stages)
    micro = micro_batches if micro_batches is not None else pipeline_parallel * virtual
    check_micro_batches(spec, micro, pipeline_parallel)
    return PipelineConfig(
        pipeline_parallel, spec, virtual, micro, None if boundaries is None else tuple(boundaries)
    )


def checkpointing(mode: Any, policy: Any) -> CheckpointingConfig | None:
    if mode is None:
        if policy is not None:
            raise ValueError(
                f"`activation_checkpointing_policy={policy!r}` needs `activation_checkpointing='selective'`;"
                " without it nothing is recomputed."
            )
        return None
    if mode not in ("full", "selective"):
        raise ValueError(
            f"`activation_checkpointing={mode!r}` is not supported: use 'full' (recompute every block),"
            " 'selective' (see `activation_checkpointing_policy`) or None."
        )
    if mode == "full":
        if policy is not None:
            raise ValueError(
                f"`activation_checkpointing='full'` recomputes every block; `activation_checkpointing_policy="
                f"{policy!r}` chooses what to recompute, so use it with `activation_checkpointing='selective'`."
            )
        return CheckpointingConfig("full")
    if policy is None or policy == "ops":
        return CheckpointingConfig("selective", ops=True)
    if policy == "ops_alternate_matmuls":
        return CheckpointingConfig("selective", ops=True, alternate_matmuls=True)
    if isinstance(policy, int) and not isinstance(policy, bool):
        if policy < 1:
            raise ValueError(f"`activation_checkpointing_policy={policy!r}`: every k-th block needs k >= 1.")
        return CheckpointingConfig("selective", every=policy)
    if isinstance(policy, (list, tuple)) and policy and all(isinstance(p, str) for p in policy):
        return CheckpointingConfig("selective", patterns=tuple(policy))
    raise ValueError(
        f"`activation_checkpointing_policy={policy!r}` is not supported: use 'ops' (Megatron-style selective"
        " recomputation inside every block), 'ops_alternate_matmuls' (the same, every second projection matmul"
        " recomputed too), an integer k (recompute every k-th block), or a list of"
        " module-name patterns such as ['model.transformer.h.*.mlp']."
    )


def gradient_compression(value: Any) -> GradientCompression | None:
    if value is None or isinstance(value, PowerSGD):
        return value
    if value == "powersgd":
        return PowerSGD()
    if isinstance(value, str) and value in CASTS:
        return value
    raise ValueError(
        f"`gradient_compression={value!r}` is not supported: use 'bf16' or 'fp16' (all-reduce in half"
        " precision), 'powersgd' or `lightning_parallel.comm.PowerSGD(rank=...)` (low-rank with error"
        " feedback), or None. (1-bit and fp8 all-reduces are not offered: summing fp8 values over ranks"
        " overflows and rounds too coarsely without per-rank scaling, which gloo and NCCL do not do.)"
    )


def memory_savers(
    activation_checkpointing: Any,
    policy: Any,
    activation_offload: Any,
    activation_compression: Any,
    gradient_compression_arg: Any,
) -> MemorySaverConfig:
    resolved = checkpointing(activation_checkpointing, policy)
    if not isinstance(activation_offload, bool):
        raise ValueError(f"`activation_offload={activation_offload!r}` must be True or False.")
    if activation_compression is not None and activation_compression not in COMPRESSIONS:
        raise ValueError(
            f"`activation_compression={activation_compression!r}` is not supported: use 'bf16' (half the"
            " bytes, gradients within about 2^-8 relative), 'fp8' (a quarter, about 2^-4) or None."
        )
    compression = gradient_compression(gradient_compression_arg)
    return MemorySaverConfig(resolved, activation_offload, activation_compression, compression)
