"""One process of a harness launch: trains a list of cases through the real ``lightning.Trainer``.

Started by :mod:`tests.distributed.harness`, never by hand::

    python -m tests.distributed.worker --cases CASES.pkl --out DIR [--pg-timeout S] [--no-init-pg]

CASES.pkl holds ``{"distributed": [Case, ...], "reference": [Case, ...]}``. The parent sets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT, so Lightning's ``LightningEnvironment`` sees processes created
externally and launches nothing. The worker opens the gloo process group itself (with a short
timeout) and every case's strategy finds it open and reuses it (Lightning's
``_init_dist_connection`` returns early when ``torch.distributed.is_initialized()``).
Then the worker closes the group, removes the launcher variables, and runs the reference cases
(``strategy="auto"``, ``devices=1``), reference ``j`` on rank ``j % WORLD_SIZE``: the imports
are paid once for both. A reference-only launch is one process without those variables.

Files written to DIR: ``result.<i>.pt`` (rank 0, distributed case ``i``), ``reference.<j>.pt``,
``done.rank<r>`` after the last case, ``error.rank<r>.txt`` with the case and traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_parallel.tensor_parallel.row_layout import row_layout
from tests.compat import case_rows
from tests.distributed.cases import Case, Fault, GradientFault, StrategySpec
from tests.distributed.compute_dtype import EXPECTED_DTYPES, ComputeDtypeCounter
from tests.distributed.engagement import (
    CollectiveCounter,
    ForwardProbe,
    engagement_problems,
    merge_records,
    rank_record,
)
from tests.distributed.engagement_evidence import host_step_overlap_expected
from tests.distributed.gpu_checks import gpu_checks_on_the_cpu
from tests.distributed.harness import mean_over_ranks, merge_replicas, mismatch
from tests.distributed.plan_switches import plan_feature_switched_off
from tests.environment import LAUNCHER_VARIABLES
from tests.models.families import build, make_dataloader, reference_dataloader

_DIST_ENV = LAUNCHER_VARIABLES


class ParityRecorder(Callback):
    """Records the per-batch training loss and the final full parameters of the user's module.

    Loss: the ``training_step`` loss of every batch (Lightning's ``outputs["loss"]`` times
    ``accumulate_grad_batches``, which Lightning divided out). At the end, rank 0 averages each
    batch over the ranks that returned a loss: every data-parallel replica has the same number of
    such ranks (its tensor-parallel ranks, or those of its last pipeline stage), so this is the
    mean over replicas, which is the global-batch loss one process computes.

    Parameters: ``pl_module.named_parameters()`` (the user's names, not a wrapper's; a module several blocks
    share under the one-process name, where a pipeline stage knows it by its own blocks'), DTensors
    gathered with ``full_tensor()``, meta tensors (parameters another stage owns) skipped. Rank 0
    keeps the lowest rank's copy of each name and records any other copy that differs from it
    beyond the parity tolerance (replicas out of sync).
    """

    def __init__(self, case: Case | None = None) -> None:
        self.losses: list[float | None] = []
        self.payload: dict[str, Any] | None = None
        self.case = case  # None for a reference: nothing to prove engaged
        self.probe: ForwardProbe | None = None
        # One dispatch mode from each batch's start to its end: matrix products counted until the optimizer
        # steps; a distributed run's collectives counted throughout.
        self.collectives: CollectiveCounter | None = CollectiveCounter() if case is not None else None
        self.dtypes = ComputeDtypeCounter(self.collectives)
        self.initial: dict[str, torch.Tensor] = {}  # a reference's parameters before training

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.case is None:  # one process: the parameters are whole, and tell what trained
            self.initial = {n: p.detach().float().clone() for n, p in pl_module.named_parameters()}
        if self.case is not None:
            self.probe = ForwardProbe(pl_module)  # after setup: behind the strategy's own hooks
            if self.case.switch_off == "activation_checkpointing":  # test-only negative control
                for module in pl_module.modules():
                    module.__dict__.pop("forward", None)  # the class's forward again: no recomputation
            if self.case.switch_off == "row_copies":  # test-only: the copies of a row no longer summed
                sync = trainer.strategy.parallelized.gradients.after_backward
                sync.rest = [group for group in sync.rest if type(group).__name__ != "RowCopies"]
            if (
                self.case.switch_off == "host_step_wait"
            ):  # test-only: host steps during backward despite clipping
                from lightning_parallel.strategy.zero_setup import host_step_parameters
                from lightning_parallel.zero.overlapped_step import OverlappedHostStep

                optimizer = trainer.strategy.optimizers[0]
                optimizer = getattr(optimizer, "_optimizer", optimizer)
                trainer.strategy.host_step = OverlappedHostStep(
                    optimizer, host_step_parameters(trainer.strategy)
                )

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.dtypes.__enter__()
        self.dtypes.counting = True

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        if (
            self.case is None
        ):  # a reference recomputes nothing and counts no collective: skip the backward's ops
            self.dtypes.__exit__(None, None, None)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.case is None:
            self.dtypes.__enter__()

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.dtypes.counting = False  # the optimizer's own products (if any) are not the forward's

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.dtypes.counting = False
        self.dtypes.__exit__(None, None, None)
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self.losses.append(
            None if loss is None else float(loss.detach().float()) * trainer.accumulate_grad_batches
        )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        from lightning_parallel.zero.tensor_parallel import user_named_parameters

        params = {}
        slices: dict[str, tuple[int, torch.Tensor]] = {}  # expert shards: name -> (first expert, slice)
        with gathered_zero_parameters(trainer.strategy, pl_module):
            named = [
                (name, param, param.detach().clone()) for name, param in user_named_parameters(pl_module)
            ]
        copies_apart: dict[str, str] = {}
        runner = getattr(getattr(trainer.strategy, "parallelized", None), "pipeline", None)
        one_process_name = runner.weights_named_apart if runner is not None else {}
        for name, param, tensor in named:
            name = one_process_name.get(name, name)  # a module shared by blocks: this stage's name for it
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            if tensor.is_meta:
                continue
            layout = row_layout(param)  # rows stored in another order or on several ranks: the user's tensor
            if layout is not None:
                user = layout.user(tensor)
                problem = mismatch(layout.stored(user), tensor)  # every copy of a row equal
                if problem:
                    copies_apart[f"{name} (copies of its rows)"] = problem
                tensor = user
            shard = getattr(param, "_lp_expert_shard", None)
            if shard is not None and shard.dim == 0 and shard.ep_size > 1:
                slices[name] = (shard.first_expert, tensor.cpu().clone())
            else:
                params[name] = tensor.cpu().clone()
        record = (
            rank_record(trainer.strategy, pl_module, self.probe, self.collectives, trainer.global_step)
            if self.case is not None
            else {}
        )
        if self.probe is not None:
            self.probe.remove()
        record["compute_dtypes"] = dict(self.dtypes.counts)
        if self.case is not None:  # what backward ran again: every op, and the matrix products among them
            record["recomputed_ops"] = self.dtypes.recomputed_ops
            record["recomputed_matmuls"] = sum(
                n for key, n in self.dtypes.counts.items() if key.startswith("recomputed.")
            )
        mine = (self.losses, params, slices, (_mesh_coordinates(trainer.strategy), record))
        if dist.is_available() and dist.is_initialized():
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            if dist.get_rank() != 0:
                return
        else:
            gathered = [mine]
        # Expert-parallel stacked weights: each rank holds experts [first, first + n) of the same
        # name; the full tensor is their concatenation. Replicas of one slice must agree.
        by_name: dict[str, dict[int, list[torch.Tensor]]] = {}
        coordinates = [coords for *_, (coords, _) in gathered]
        records = [record for *_, (_, record) in gathered]
        compute_dtypes: dict[str, int] = {}
        for rank_record_ in records:
            for key, count in rank_record_.pop("compute_dtypes").items():
                compute_dtypes[key] = compute_dtypes.get(key, 0) + count
        engagement = merge_records(records)
        gathered = [(losses, params, slices) for losses, params, slices, _ in gathered]
        for _, _, rank_slices in gathered:
            for name, (first, tensor) in rank_slices.items():
                by_name.setdefault(name, {}).setdefault(first, []).append(tensor)
        experts_full: dict[str, torch.Tensor] = {}
        for name, parts in by_name.items():
            experts_full[name] = torch.cat([parts[first][0] for first in sorted(parts)], dim=0)
        replica_sets = [dict(p) for _, p, _ in gathered]
        for name, parts in by_name.items():
            # Compare replicas of each slice through merge_replicas: one entry per (name, slice).
            for first, copies in parts.items():
                for rank_params, copy in zip(replica_sets, copies, strict=False):
                    rank_params[f"{name}[experts {first}:]"] = copy
        gathered = [(losses, params) for (losses, _, _), params in zip(gathered, replica_sets, strict=True)]
        sampler_kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        self.payload = {
            "losses": mean_over_ranks([losses for losses, _ in gathered]),
            "rank_losses": [losses for losses, _ in gathered],
            "rank_coordinates": coordinates,
            **_with_experts(merge_replicas([p for _, p in gathered]), experts_full),
            "global_step": trainer.global_step,
            "data_parallel": int(sampler_kwargs.get("num_replicas", 1)),
            "facts": {**strategy_facts(trainer.strategy), **loss_scale_facts(trainer.strategy)},
            "engagement": engagement,
            "compute_dtypes": compute_dtypes,
            "initial_params": self.initial,
        }
        self.payload["replica_mismatches"].update(copies_apart)  # the full tensors are alike on every rank
        if self.case is not None:
            facts = {**self.payload["facts"], "data_parallel": self.payload["data_parallel"]}
            spec = self.case.strategy
            facts["host_step_overlap_expected"] = host_step_overlap_expected(
                engagement, self.case.trainer_kwargs, spec.kwargs if isinstance(spec, StrategySpec) else {}
            )
            kwargs = spec.kwargs if isinstance(spec, StrategySpec) else {}
            options = {"gather=compute"} if kwargs.get("zero_gather_dtype") == "compute" else set()
            precision = str(self.case.trainer_kwargs.get("precision", "32-true"))
            facts["autocast_dtype"] = EXPECTED_DTYPES[precision] if precision.endswith("-mixed") else None
            self.payload["engagement_problems"] = engagement_problems(
                case_rows(self.case) | options, engagement, facts
            )


def _number(value: Any) -> Any:
    return float(value) if isinstance(value, torch.Tensor) else value


LOSS_SCALE = {"init_scale": 2.0**8, "growth_interval": 2}  # the 16-mixed cases' GradScaler
CALLBACK_FACTS = ("threshold", "pruned", "selected", "sparsity", "last_kd_loss", "last_task_loss")


def _mesh_coordinates(strategy: Any) -> dict[str, int]:
    """This rank's coordinate on each named axis of the strategy's mesh (empty without one)."""
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is None or mesh.mesh_dim_names is None:
        return {}
    return dict(zip(mesh.mesh_dim_names, (int(c) for c in mesh.get_coordinate()), strict=True))


def strategy_facts(strategy: Any) -> dict[str, int]:
    """Counts that show a feature ran (rank 0's): attention calls routed over the context split, its bytes."""
    from lightning_parallel.context_parallel import TRAFFIC

    parallelized = getattr(strategy, "parallelized", None)
    context = getattr(parallelized, "context", None)
    if context is None:
        return {}
    return {
        "context_calls": context.calls,
        **{f"context_{k}_bytes": v for k, v in TRAFFIC.snapshot().items()},
    }


def loss_scale_facts(strategy: Any) -> dict[str, float]:
    """The fp16 loss scale the run ended with (``16-mixed``): Lightning's GradScaler, ours, or ZeRO's."""
    scaler = getattr(getattr(strategy, "precision_plugin", None), "scaler", None)
    if scaler is None:
        return {}
    facts = {"loss_scale": float(scaler.get_scale())}
    if hasattr(scaler, "skipped_steps"):  # zero/loss_scale.py: DeepSpeed's engine skipped these steps
        facts["loss_scale_skipped_steps"] = int(scaler.skipped_steps)
    optimizer = getattr(getattr(strategy, "zero_engine", None), "optimizer", None)
    if optimizer is not None and getattr(optimizer, "external_loss_scale", None) is not None:
        facts["zero_external_loss_scale"] = float(optimizer.external_loss_scale)  # what the engine applied
    return facts


def gathered_zero_parameters(strategy: Any, module: torch.nn.Module) -> Any:
    """ZeRO-3 keeps a partition of each parameter on each rank: gather them to read them."""
    from contextlib import nullcontext

    engine = getattr(strategy, "zero_engine", None)
    if engine is None or engine.zero_optimization_stage() != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


def _with_experts(merged: dict, experts_full: dict[str, torch.Tensor]) -> dict:
    """Replace the per-slice entries by the reassembled full expert tensors (the reference's names)."""
    params = {n: t for n, t in merged["params"].items() if "[experts " not in n}
    params.update(experts_full)
    return {**merged, "params": params}


class FaultInjector(Callback):
    """Test-only: misbehaves as :class:`Fault` says, to prove the harness notices."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank != self.fault.rank or batch_idx != self.fault.batch_idx:
            return
        if self.fault.kind == "raise":
            raise RuntimeError(f"injected fault on rank {trainer.global_rank} at batch {batch_idx}")
        sys.stdout.flush()
        sys.stderr.flush()
        if self.fault.kind == "exit0":
            os._exit(0)
        time.sleep(3600)


class GradientFaultInjector(Callback):
    """Test-only: scales one layer's gradients before each optimizer step (a parity test's negative control)."""

    def __init__(self, fault: GradientFault) -> None:
        self.fault = fault

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        for name, param in pl_module.named_parameters():
            if self.fault.name in name and param.grad is not None:
                param.grad.mul_(self.fault.factor)


def _precision_kwargs(trainer_kwargs: Mapping[str, Any], data_parallel: int = 1) -> dict[str, Any]:
    """The case's ``Trainer`` arguments; ``precision="fp8"`` (not a Lightning flag) becomes the plugin, and
    ``"16-mixed"`` Lightning's ``MixedPrecision("16-mixed", "cpu")`` (fp16 autocast and a GradScaler on the
    CPU; the flag alone would become bf16-mixed there); the strategies convert it to their own.

    fp8 runs in torchao's emulation (fp8 rounding of the matmul inputs, the matmuls in higher
    precision): the same numerics as fp8 hardware up to the matmul's accumulation, on a CPU.

    ``data_parallel``: a one-process reference of a run whose batch is split over that many replicas. Each
    replica's loss is the mean over its share, so its per-token gradients are ``data_parallel`` times the
    one process's (the replicas' mean is taken after backward). fp16 rounds those numbers apart where they
    are tiny (subnormals: measured on ep2, layer 0's expert biases 80 fp16 units off after 4 steps, bitwise
    equal after one step at the scale below); a loss scale ``data_parallel`` times the run's gives the
    reference the very fp16 gradients each replica computes. Scaling is exact in either run.
    """
    kwargs = dict(trainer_kwargs)
    if kwargs.get("precision") == "16-mixed":  # Lightning would run bf16 on the CPU: fp16 autocast, scaled
        from lightning.pytorch.plugins.precision import MixedPrecision

        del kwargs["precision"]
        # No overflow in any run (a rank's half batch has twice the per-token gradients of one process's
        # whole batch: at 2**16 a rank overflowed where one process did not); doubling every 2 clean steps,
        # so the final scale shows that every step was checked and taken alike.
        scale = {**LOSS_SCALE, "init_scale": LOSS_SCALE["init_scale"] * data_parallel}
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", **scale))]
    if kwargs.get("precision") == "fp8":
        from tests.optional_packages import use_optional_packages

        use_optional_packages()  # torchao lives in .venv/extras
        from lightning_parallel.precision.fp8 import Float8Precision

        del kwargs["precision"]
        kwargs["plugins"] = [Float8Precision(emulate=True)]
    return kwargs


@contextmanager
def _engine_precision_switched_off(case: Case, reference: bool) -> Iterator[None]:
    """Test-only (``Case.switch_off="zero_autocast"``): DeepSpeed's engine config as before issue 33, without
    the ``torch_autocast`` section for the case's precision (the engine then switches Lightning's autocast
    off on a GPU, and here, where ``gpu_checks_on_the_cpu`` makes its check see the CPU)."""
    if reference or case.switch_off != "zero_autocast":
        yield
        return
    from lightning_parallel.zero import arguments

    precision = str(case.trainer_kwargs.get("precision"))
    saved = arguments.ZERO_PRECISIONS[precision]
    arguments.ZERO_PRECISIONS[precision] = None
    try:
        yield
    finally:
        arguments.ZERO_PRECISIONS[precision] = saved


def compute_weight_copies(model: L.LightningModule, dtype: torch.dtype) -> None:
    """The one-process rule of ``zero_gather_dtype="compute"``, written without FSDP2: every forward of the
    model's parameter-holding children runs on ``dtype`` copies of their parameters (one copy per parameter per
    call, so tied uses sum their gradients in ``dtype``, as FSDP2's one unsharded parameter does); each copy's
    gradient is cast back to the fp32 parameter by the copy's backward."""
    for child in model.children():
        if next(child.parameters(), None) is not None:
            _forward_on_copies(child, dtype)


def _forward_on_copies(child: nn.Module, dtype: torch.dtype) -> None:
    def forward(*args: Any, **kwargs: Any) -> Any:
        copies: dict[int, torch.Tensor] = {}
        weights = {
            name: copies.setdefault(id(p), p.to(dtype)) if p.is_floating_point() else p
            for name, p in child.named_parameters(remove_duplicate=False)
        }
        del child.forward  # functional_call calls the module: its class's forward, not this one
        try:
            return torch.func.functional_call(child, weights, args, kwargs, tie_weights=False)
        finally:
            child.forward = forward

    child.forward = forward


@contextmanager
def _compute_gathers_switched_off(case: Case, reference: bool) -> Iterator[None]:
    """Test-only (``Case.switch_off="compute_gathers"``): ``zero_gather_dtype="compute"`` accepted and then
    ignored, the units gathering fp32 (the negative control of the gather-dtype record)."""
    if reference or case.switch_off != "compute_gathers":
        yield
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_parallel.zero import fsdp

    saved = fsdp.gather_policy
    fsdp.gather_policy = lambda dtype: MixedPrecisionPolicy()
    try:
        yield
    finally:
        fsdp.gather_policy = saved


@contextmanager
def _grouped_mm_autocast(case: Case, reference: bool) -> Iterator[None]:
    """The one-process run computes grouped products (Hugging Face's MoE experts) in the precision the strategy
    gives them: Lightning's own plugin lacks the autocast rule this package's plugins register
    (``lightning_parallel/precision/grouped_mm_autocast.py``). ``Case.switch_off="grouped_mm_autocast"`` takes
    the rule away from the distributed run (the negative control of the compute-dtype record)."""
    from lightning_parallel.precision import grouped_mm_autocast as rule
    from lightning_parallel.precision import plugin
    from lightning_parallel.zero import precision as zero_precision

    mixed = str(case.trainer_kwargs.get("precision", "32-true")).endswith("-mixed")
    if reference or case.switch_off != "grouped_mm_autocast":
        if reference and mixed:
            rule.register_grouped_mm_autocast()
        yield
        return
    rule.unregister_grouped_mm_autocast()
    saved = plugin.register_grouped_mm_autocast, zero_precision.register_grouped_mm_autocast
    plugin.register_grouped_mm_autocast = zero_precision.register_grouped_mm_autocast = lambda: None
    try:
        yield
    finally:
        plugin.register_grouped_mm_autocast, zero_precision.register_grouped_mm_autocast = saved


def _run_case(case: Case, out_file: Path, reference: bool, env: dict[str, str], startup_s: float) -> None:
    case_start = time.perf_counter()
    for key in _DIST_ENV:  # LightningEnvironment.teardown() deletes WORLD_SIZE after each fit
        os.environ.pop(key, None)
    os.environ.update(env)
    L.seed_everything(case.seed, verbose=False)
    from lightning_parallel.context_parallel import TRAFFIC

    TRAFFIC.reset()
    model = build(case.family, **case.model_kwargs)
    if case.reference_rule not in (None, "compute_weights"):
        raise ValueError(f"{case.name}: unknown reference_rule {case.reference_rule!r}")
    if reference and case.reference_rule == "compute_weights":
        compute_weight_copies(model, getattr(torch, EXPECTED_DTYPES[str(case.trainer_kwargs["precision"])]))
    if reference:
        devices, strategy = 1, "auto"
        loader = reference_dataloader(
            case.batch_size, case.dp, case.num_samples, sampler_seed=case.seed, data=case.data,
            reverse_within_batch=case.reversed_batches,
        )  # fmt: skip
    else:
        devices, loader = case.world_size, make_dataloader(case.batch_size, case.num_samples, data=case.data)
        strategy = case.strategy if isinstance(case.strategy, str) else case.strategy.build()
    recorder = ParityRecorder(None if reference else case)
    extra = [spec.build() for spec in case.callbacks]
    callbacks: list[Callback] = [recorder, *extra]
    if case.fault is not None and not reference:
        callbacks.append(FaultInjector(case.fault))
    if case.gradient_fault is not None and not reference:
        callbacks.append(GradientFaultInjector(case.gradient_fault))
    trainer_kwargs = dict(
        accelerator="cpu", devices=devices, num_nodes=1, strategy=strategy, max_steps=case.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=True, deterministic=True, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip
    precision = _precision_kwargs(case.trainer_kwargs, case.dp if reference else 1)
    trainer = L.Trainer(**{**trainer_kwargs, **precision})
    if not reference and trainer.global_rank != int(env["RANK"]):
        raise RuntimeError(f"Trainer global_rank {trainer.global_rank} != RANK {env['RANK']}")
    group = dist.group.WORLD if dist.is_initialized() else None
    start = time.perf_counter()
    switched_off = plan_feature_switched_off(case.switch_off, reference)
    with (
        _compute_gathers_switched_off(case, reference),
        gpu_checks_on_the_cpu(case.gpu_checks),
        _engine_precision_switched_off(case, reference),
        _grouped_mm_autocast(case, reference),
        switched_off,
    ):
        trainer.fit(model, train_dataloaders=loader)
    wall_s = time.perf_counter() - start
    if group is not None and (not dist.is_initialized() or dist.group.WORLD is not group):
        raise RuntimeError(
            f"{type(trainer.strategy).__name__} destroyed or replaced the default process group it found"
            " open; a strategy must reuse a group it did not create and leave it open."
        )
    if recorder.payload is not None:  # rank 0, or the process running this reference
        if reference:
            recorder.payload["data_parallel"] = case.dp
        recorder.payload["precision"] = str(case.trainer_kwargs.get("precision", "32-true"))
        case_s = time.perf_counter() - case_start
        for callback in extra:  # what a case's callback did (pruning: its threshold and counts)
            recorder.payload["facts"].update(
                {k: _number(getattr(callback, k)) for k in CALLBACK_FACTS if hasattr(callback, k)}
            )
        recorder.payload.update(
            name=case.name, world_size=devices, wall_s=wall_s, case_s=case_s, startup_s=startup_s
        )
        torch.save(recorder.payload, out_file)
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", type=Path, required=True, help="pickled {'distributed': [...], 'reference': [...]}"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for results and markers")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    parser.add_argument(
        "--no-init-pg", action="store_true", help="let the first case's strategy open the group"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", ".*treespec, LeafSpec.*")

    dist_env = {k: os.environ[k] for k in _DIST_ENV if k in os.environ}
    rank, nprocs = int(dist_env.get("RANK", 0)), int(dist_env.get("WORLD_SIZE", 1))
    cases: dict[str, list[Case]] = pickle.loads(args.cases.read_bytes())
    current = "<setup>"
    try:
        if cases["distributed"] and not args.no_init_pg:
            timeout = timedelta(seconds=args.pg_timeout)
            dist.init_process_group("gloo", rank=rank, world_size=nprocs, timeout=timeout)
        startup_s = time.time() - float(os.environ.get("LP_HARNESS_LAUNCH_TIME", time.time()))
        for index, case in enumerate(cases["distributed"]):
            current = case.name
            _run_case(case, args.out / f"result.{index}.pt", False, dist_env, startup_s)
        current = "<closing the process group>"
        if dist.is_initialized():
            dist.destroy_process_group()
        # References: one process each, no process group, no launcher variables; spread over the ranks.
        for index, case in enumerate(cases["reference"]):
            if index % nprocs == rank:
                current = f"{case.name} (reference)"
                _run_case(case, args.out / f"reference.{index}.pt", True, {}, startup_s)
        (args.out / f"done.rank{rank}").write_text("ok\n")
    except BaseException:
        message = f"rank {rank}, case {current}:\n{traceback.format_exc()}"
        (args.out / f"error.rank{rank}.txt").write_text(message)
        sys.stderr.write(message)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)  # never hang in interpreter shutdown with a broken process group


if __name__ == "__main__":
    main()
