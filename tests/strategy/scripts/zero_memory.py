"""Bytes per rank of parameters, gradients and optimizer states under ZeRO 1/2/3, through the Trainer.

    python tests/strategy/scripts/zero_memory.py OUT_DIR   # RANK/WORLD_SIZE/MASTER_* from the launcher

On every data-parallel rank, nanoGPT (fp32, AdamW) trains two steps under
``HybridParallelStrategy(zero_stage=s)`` for s = 1, 2, 3 in turn (one process group). Measured on
each rank from the tensors DeepSpeed's optimizer holds:

- parameters: the module's copy (stages 1/2: DeepSpeed's flat buffers the parameters point into;
  stage 3: each parameter's partition ``ds_tensor``) plus the fp32 master partition;
- gradients: the peak, over the end of backward (``on_before_optimizer_step``) and the inside of
  the optimizer step, of the bytes of every gradient tensor alive: the module's ``.grad`` and the
  partition buffers ZeRO keeps. Not counted: the reduction buckets, bounded by
  ``reduce_bucket_size`` whatever the model size;
- optimizer states: after the step, every tensor in the state of the optimizer ZeRO steps.

Every rank writes ``OUT_DIR/zero_memory.rank{r}.json``; the theory is in
``tests/zero/test_zero_memory.py``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_parallel import HybridParallelStrategy
from tests.models.families import build, make_dataloader

STEPS, BATCH = 1, 2
# Deep enough that one parameter split at a partition boundary is small against a partition.
LAYERS = 12


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _gradient_bytes(module: torch.nn.Module, zero: Any) -> int:
    """Every gradient tensor alive: the module's ``.grad`` and the partition buffers ZeRO keeps."""
    held = [p.grad for p in module.parameters() if p.grad is not None]
    held += [getattr(zero, "grads_in_partition", None), getattr(zero, "grad_partitions_flat_buffer", None)]
    for grads in (getattr(zero, "averaged_gradients", None) or {}).values():
        held += list(grads or [])
    held += [g.grad for g in getattr(zero, "single_partition_of_fp32_groups", [])]
    held += [g.grad for g in getattr(zero, "fp32_partitioned_groups_flat", [])]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if t is not None}
    return sum(storages.values())


class ZeroBytes(L.Callback):
    """Gradients: the peak over the point after backward and the inside of the optimizer step."""

    def __init__(self) -> None:
        self.measured: dict[str, int] = {"gradients": 0}

    def _gradients(self, module: torch.nn.Module, zero: Any) -> None:
        self.measured["gradients"] = max(self.measured["gradients"], _gradient_bytes(module, zero))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        zero = trainer.strategy.zero_engine.optimizer
        inner = zero.optimizer
        step = inner.step

        def measured_step(*args: Any, **kwargs: Any) -> Any:
            self._gradients(pl_module, zero)
            return step(*args, **kwargs)

        inner.step = measured_step

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        self._gradients(pl_module, trainer.strategy.zero_engine.optimizer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        zero = trainer.strategy.zero_engine.optimizer
        if trainer.strategy.zero.stage == 3:
            module = _bytes(p.ds_tensor for p in pl_module.parameters())
            master = _bytes(zero.fp32_partitioned_groups_flat)
        else:
            module = _bytes(zero.bit16_groups_flat)
            master = _bytes(zero.single_partition_of_fp32_groups)
        states = _bytes(v for state in zero.optimizer.state.values() for v in state.values() if v.dim() > 0)
        self.measured.update(module_parameters=module, master_parameters=master, optimizer_states=states)


def _local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of (DTensor) tensors: their local shards."""
    from torch.distributed.tensor import DTensor

    return _bytes(t.to_local() if isinstance(t, DTensor) else t for t in tensors)


def _tensor_parallel_numel(module: torch.nn.Module) -> int:
    """Elements a rank would hold under tensor parallelism alone (each weight's tp shard, replicas whole)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # fused q|k|v (not a Shard)

    total = 0
    for param in module.parameters():
        if not isinstance(param, DTensor):
            total += param.numel()
            continue
        names = param.device_mesh.mesh_dim_names or ()
        tp_axis = names.index("tp") if "tp" in names else None  # FSDP2's dp-only mesh: replicated over tp
        sharded = tp_axis is not None and isinstance(param.placements[tp_axis], (Shard, _StridedShard))
        total += param.numel() // (param.device_mesh.size(tp_axis) if sharded else 1)
    return total


class FsdpBytes(L.Callback):
    """ZeRO-3 with tensor parallelism (FSDP2): the shards of parameters, gradients and optimizer states."""

    def __init__(self) -> None:
        self.measured: dict[str, int] = {}

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        self.measured["gradients"] = _local_bytes(
            p.grad for p in pl_module.parameters() if p.grad is not None
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        optimizer = trainer.optimizers[0]
        states = [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
        from torch.distributed.tensor import DTensor

        self.measured.update(
            module_parameters=_local_bytes(pl_module.parameters()), master_parameters=0,
            optimizer_states=_local_bytes(states), tensor_parallel_numel=_tensor_parallel_numel(pl_module),
            optimizer=type(optimizer).__name__, sharded_states=all(isinstance(v, DTensor) for v in states),
        )  # fmt: skip
        self.measured.update(_partial_offload(trainer, optimizer))
        files = getattr(optimizer, "files", None)  # offload="nvme": the states in files between steps
        if files is not None:
            from lightning_parallel.zero.nvme_states import padded

            shards = [p.to_local() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
            self.measured.update(
                nvme_disk_bytes=files.disk_bytes(), nvme_written_bytes=files.bytes_written,
                nvme_padded_bytes=sum(2 * 4 * padded(t.numel()) for t in shards),
            )  # fmt: skip


def _partial_offload(trainer: L.Trainer, optimizer: Any) -> dict[str, Any]:
    """Which elements partial offload kept on the device, and whether each FSDP2 unit's offload policy agrees
    with the marks the optimizer steps by (CPU Adam for the offloaded ones, torch's Adam for the rest)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from lightning_parallel.compat import fsdp_param_groups, fsdp_state
    from lightning_parallel.zero.fsdp import KEPT_ON_DEVICE, unit_parameters

    params = [p for group in optimizer.param_groups for p in group["params"]]
    kept = sum(p.numel() for p in params if getattr(p, KEPT_ON_DEVICE, False))
    units = [m for m in trainer.lightning_module.modules() if hasattr(m, "_get_fsdp_state")]
    agree, unit_fractions = True, []
    for unit in units:
        owned = unit_parameters(unit)
        offloaded = isinstance(fsdp_param_groups(fsdp_state(unit))[0].offload_policy, CPUOffloadPolicy)
        agree &= all(getattr(p, KEPT_ON_DEVICE, False) != offloaded for p in owned)
        unit_fractions.append(sum(p.numel() for p in owned) / max(1, sum(p.numel() for p in params)))
    return {"kept_fraction": kept / max(1, sum(p.numel() for p in params)), "policies_agree": agree,
            "largest_unit_fraction": max(unit_fractions, default=0.0), "units": len(units)}  # fmt: skip


class PipelinedFsdpBytes(L.Callback):
    """ZeRO-2/3 on FSDP2 under pipeline stages: what a rank holds of its stage, after the step.

    The optimizer's parameters are the fp32 masters (FSDP2's shards); the module's registered ones are
    the same tensors at ZeRO-3 and the gathered whole parameters at ZeRO-2 (kept between steps).
    """

    def __init__(self) -> None:
        self.measured: dict[str, int] = {}

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        self.measured["gradients"] = _local_bytes(p.grad for p in masters if p.grad is not None)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        optimizer = trainer.optimizers[0]
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        registered = list(trainer.strategy.pipeline_runner.stage_modules[0].parameters())
        same = {id(p) for p in masters} == {id(p) for p in registered}
        states = [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
        self.measured.update(
            module_parameters=_local_bytes(registered), master_parameters=0 if same else _local_bytes(masters),
            optimizer_states=_local_bytes(states), stage_parameters=sum(p.numel() for p in masters),
        )  # fmt: skip


def _train(
    family: str, strategy: HybridParallelStrategy, probe: L.Callback, devices: int, data_parallel: int
) -> tuple[L.LightningModule, L.Trainer, int]:
    """The seeded module (AdamW) trained ``STEPS`` steps under ``strategy``; its trainable elements before."""
    L.seed_everything(0, verbose=False)
    module = build(family, optimizer="adamw", **({"n_layer": LAYERS} if family == "nanogpt" else {}))
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, callbacks=[probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, make_dataloader(BATCH, STEPS * BATCH * data_parallel))
    return module, trainer, numel


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    results: dict[str, Any] = {}
    devices = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    for stage in (1, 2, 3):
        probe = ZeroBytes()
        _, trainer, numel = _train("nanogpt", HybridParallelStrategy(zero_stage=stage, timeout=60), probe, devices,
                                   devices)  # fmt: skip
        results[f"zero{stage}"] = {"parameters": numel, "world_size": trainer.world_size, **probe.measured}
    if devices != 4:
        (out_dir / f"zero_memory.rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))
        return
    # ZeRO-3 with tensor parallelism (FSDP2 over dp=2 of tp=2 shards), on the device and offloaded.
    for offload, ratio in ((None, 1.0), ("cpu", 1.0), ("nvme", 1.0), ("cpu", 0.5)):
        probe = FsdpBytes()
        path = str(out_dir / "nvme") if offload == "nvme" else None
        strategy = HybridParallelStrategy(zero_stage=3, tensor_parallel=2, offload=offload, offload_path=path,
                                          offload_ratio=ratio, timeout=60)  # fmt: skip
        _, trainer, numel = _train("nanogpt", strategy, probe, devices, 2)
        name = (f"zero3_{offload}_tp2" if offload else "zero3_tp2") + ("_half" if ratio < 1 else "")
        results[name] = {"parameters": numel, "world_size": trainer.world_size, **probe.measured}
    for stage in (2, 3):  # ZeRO-2/3 on FSDP2 under two pipeline stages (dp=2)
        probe = PipelinedFsdpBytes()
        strategy = HybridParallelStrategy(zero_stage=stage, pipeline_parallel=2, micro_batches=2, timeout=60)
        _, trainer, _ = _train("nanogpt", strategy, probe, devices, 2)
        results[f"zero{stage}_pp2"] = {"world_size": trainer.world_size, **probe.measured}
    # ZeRO-3 with expert parallelism (FSDP2): ep=2 x dp_replicate=2, experts sharded over their 2 replicas.
    from lightning_parallel.experts import expert_parameters, find_moe_blocks

    whole = build("hf_mixtral", optimizer="adamw")
    names = {n for info in find_moe_blocks(whole) for n in info.expert_param_names}
    expert_numel = sum(p.numel() for n, p in whole.named_parameters() if n in names)
    probe = FsdpBytes()
    module, trainer, numel = _train("hf_mixtral", HybridParallelStrategy(zero_stage=3, expert_parallel=2, timeout=60),
                                    probe, devices, devices)  # fmt: skip
    held = _local_bytes(expert_parameters(module).values())
    results["zero3_ep2"] = {"parameters": numel, "expert_parameters": expert_numel, "expert_bytes": held,
                            **probe.measured}  # fmt: skip
    (out_dir / f"zero_memory.rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
