"""``offload_update=ImportanceSplit(...)`` trains by its defined rule (``zero/importance_split.py``), not the exact one.

The reference replays the rule in one process, with its own Adam arithmetic on whole tensors, on the very
gradients the run computed (``tests/zero/gradient_capture.py`` says why: the forward and backward are the
exact path's, held to the one-process run by the parity suite): each matrix's chosen rows (largest gradient
norm over the whole parameter) step at once, the others' gradients are summed and applied as one step with
their mean every ``update_interval`` steps, installed at the next step; rows are chosen again every
``select_interval`` steps; the end of training installs the update in flight and applies what is pending.
The strategy (FSDP2 with CPU offload) must match it to the parity rule on one process and on two (where each
rank holds part of each matrix's rows, and the choice is over the whole matrix); the exact rule replayed
on the same gradients must not, or the tests could not tell the rules apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_parallel import ImportanceSplit
from tests.zero.gradient_capture import GradientCapture
from tests.zero.test_delayed_update import _differences  # the parity rule on every parameter

pytest.importorskip("deepspeed")

STEPS = 6
RULE = ImportanceSplit(top_rows=0.25, update_interval=2, select_interval=4)


def _decay(step: int) -> float:
    """The learning-rate factor after ``step`` scheduler steps (the scheduled runs)."""
    return 1.0 / (1.0 + step)


def _module(zero_in_place: bool = False, scheduled: bool = False) -> L.LightningModule:
    from recipes.gpt.module import GPTLightningModule

    class AdamW(GPTLightningModule):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            if not scheduled:
                return optimizer
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _decay)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
            # In place: the worker still summing this step's gradients must have read them first.
            optimizer.zero_grad(set_to_none=not zero_in_place)

    torch.manual_seed(0)
    return AdamW(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 64, (STEPS * 2, 17), generator=torch.Generator().manual_seed(1))
    return [
        (tokens[i : i + 2, :-1].contiguous(), tokens[i : i + 2, 1:].contiguous())
        for i in range(0, STEPS * 2, 2)
    ]


class _Adam:
    """AdamW's arithmetic on rows of one tensor, written out (not torch's optimizer: the reference is independent)."""

    def __init__(self, param: torch.Tensor, hyper: dict[str, Any]) -> None:
        self.param, self.hyper = param, hyper
        self.exp_avg = torch.zeros_like(param)
        self.exp_avg_sq = torch.zeros_like(param)
        self.t = 0

    def updated(
        self, rows: torch.Tensor, grad: torch.Tensor, t: int, lr: float | None = None
    ) -> torch.Tensor:
        """The new values of ``rows`` (a boolean mask) for gradient rows ``grad`` at step count ``t`` (and learning rate
        ``lr``, the optimizer's by default); moments in place."""
        (beta1, beta2), base, eps, decay = (self.hyper[k] for k in ("betas", "lr", "eps", "weight_decay"))
        lr = base if lr is None else lr
        self.exp_avg[rows] = beta1 * self.exp_avg[rows] + (1 - beta1) * grad
        self.exp_avg_sq[rows] = beta2 * self.exp_avg_sq[rows] + (1 - beta2) * grad * grad
        corrected = self.exp_avg[rows] / (1 - beta1**t)
        scale = (self.exp_avg_sq[rows] / (1 - beta2**t)).sqrt() + eps
        return self.param[rows] * (1 - lr * decay) - lr * corrected / scale


def _replay(
    record: dict[str, Any],
    split: bool,
    saved_after: frozenset[int] = frozenset(),
    *,
    ended: bool = True,
    shards: int = 1,
    settle_lr: Callable[[int], float] | None = None,
) -> dict[str, torch.Tensor]:
    """The rule on ``record``'s gradients (``split=False``: every row at every step, AdamW). A checkpoint saved after
    step k (``saved_after``) installs the update in flight, applies what is pending and restarts the cycle; so does
    the end of ``fit`` (``ended``; not yet in a callback's ``on_train_end``). ``shards`` > 1: each of that many
    consecutive blocks of rows chooses its own share (what a rank choosing among its own rows would do). Each step
    updates at its own learning rate (``record["lrs"]``); a settle after step k at ``settle_lr(k)``, by default the
    learning rate of step k, the last summed (the negative control passes the scheduler's next one)."""
    lrs = record.get("lrs", [None] * len(record["steps"]))
    settle_lr = settle_lr or (lambda step: lrs[step - 1])
    params = {n: p.clone() for n, p in record["initial"].items()}
    adams = {n: _Adam(p, record["hyper"]) for n, p in params.items()}
    chosen: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    in_flight: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    cycle = summed = 0

    def choose(grad: torch.Tensor) -> torch.Tensor:
        masks = []
        for block in grad.chunk(shards):
            norms = block.pow(2).sum(dim=tuple(range(1, block.ndim)))
            mask = torch.zeros(block.shape[0], dtype=torch.bool)
            mask[norms.topk(math.ceil(RULE.top_rows * block.shape[0])).indices] = True
            masks.append(mask)
        return torch.cat(masks)

    def install() -> None:
        for name, rows, values in in_flight:
            params[name][rows] = values
        in_flight.clear()

    def settle(step: int) -> None:
        install()
        for name, total in pending.items():
            others = ~chosen[name]
            params[name][others] = adams[name].updated(
                others, total[others] / summed, adams[name].t, settle_lr(step)
            )
        pending.clear()
        chosen.clear()

    for step, grads in enumerate(record["steps"], start=1):
        install()
        cycle, summed = cycle + 1, summed + 1
        flush = cycle % RULE.update_interval == 0
        for name, grad in grads.items():
            adam = adams[name]
            adam.t += 1
            if not split or grad.ndim < 2:
                everything = torch.ones(grad.shape[0], dtype=torch.bool)
                params[name][everything] = adam.updated(everything, grad, adam.t, lrs[step - 1])
                continue
            rows = chosen.setdefault(name, choose(grad))
            params[name][rows] = adam.updated(rows, grad[rows], adam.t, lrs[step - 1])
            pending[name] = pending.get(name, torch.zeros_like(grad)) + grad * (~rows)[:, None]
            if flush:
                others = ~rows
                in_flight.append(
                    (
                        name,
                        others,
                        adam.updated(others, pending.pop(name)[others] / summed, adam.t, lrs[step - 1]),
                    )
                )
            if cycle % RULE.interval_of_selection == 0:
                chosen[name] = choose(grad)
        summed = 0 if flush else summed
        if step in saved_after:
            settle(step)
            cycle = summed = 0
    if ended:
        settle(len(record["steps"]))
    return params


def _strategy_run(
    stage: int,
    tmp_path: Path,
    checkpoints: bool = False,
    zero_in_place: bool = False,
    scheduled: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], L.Trainer]:
    """The parameters after training, the gradients the run computed, and the trainer."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_parallel import HybridParallelStrategy

    module = _module(zero_in_place, scheduled)
    capture = GradientCapture(str(tmp_path / "gradients.pt"))
    saving = (
        [ModelCheckpoint(tmp_path / "checkpoints", every_n_train_steps=3, save_top_k=-1)]
        if checkpoints
        else []
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=checkpoints,
        callbacks=[capture, *saving], enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, strategy=HybridParallelStrategy(zero_stage=stage, offload="cpu", offload_update=RULE),
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(_batches(), batch_size=None))
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.named_parameters()
    }
    return params, torch.load(tmp_path / "gradients.pt"), trainer


def _deferred_update(trainer: L.Trainer) -> Any:
    optimizer = trainer.strategy.optimizers[0]
    return vars(getattr(optimizer, "_optimizer", optimizer))["deferred_update"]


def _row_counts(params: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Rows of all matrices, and the chosen rows among them."""
    rows = [p.shape[0] for p in params.values() if p.ndim >= 2]
    return sum(rows), sum(math.ceil(RULE.top_rows * r) for r in rows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("stage", "zero_in_place"), [(2, False), (3, False), (2, True)])
def test_the_importance_split_trains_by_its_rule(stage: int, zero_in_place: bool, tmp_path: Path) -> None:
    got, record, trainer = _strategy_run(stage, tmp_path, zero_in_place=zero_in_place)
    assert len(record["steps"]) == STEPS
    split, exact = _replay(record, split=True), _replay(record, split=False)
    matrices = [n for n, p in split.items() if p.ndim >= 2]
    # The rules end apart, well beyond the parity tolerance, in every matrix: the comparison below can fail.
    assert set(matrices) <= set(_differences(split, exact))
    assert _differences(got, split) == []
    update = _deferred_update(trainer)
    rows, chosen = _row_counts(got)
    assert update.rows_at_once == STEPS * chosen
    assert update.rows_deferred == (STEPS // RULE.update_interval) * (rows - chosen)
    assert (update.launched, update.installed) == (
        STEPS // RULE.update_interval,
        STEPS // RULE.update_interval,
    )
    assert trainer.strategy.parallelized.gradients.fsdp_units  # FSDP2's engine ran it (forced by the option)
    assert trainer.strategy.host_step is None  # no exact host step in backward beside it


def test_the_rule_is_checked_where_it_is_written() -> None:
    from lightning_parallel import HybridParallelStrategy

    with pytest.raises(ValueError, match=r"top_rows=1\.5"):
        ImportanceSplit(top_rows=1.5)
    with pytest.raises(ValueError, match="update_interval=0"):
        ImportanceSplit(update_interval=0)
    with pytest.raises(ValueError, match="select_interval=3.*multiple of `update_interval=2`"):
        ImportanceSplit(update_interval=2, select_interval=3)
    with pytest.raises(ValueError, match=r"offload_update=ImportanceSplit\(.*with `offload=None`"):
        HybridParallelStrategy(zero_stage=2, offload_update=ImportanceSplit())
    with pytest.raises(ValueError, match="zero_stage=1"):
        HybridParallelStrategy(zero_stage=1, offload="cpu", offload_update=ImportanceSplit())
    strategy = HybridParallelStrategy(zero_stage=2, offload="cpu", offload_update=ImportanceSplit())
    assert strategy.config.zero.update == ImportanceSplit(top_rows=0.05, update_interval=4)


@pytest.mark.timeout(300)
def test_a_checkpoint_holds_every_gradient_seen(tmp_path: Path) -> None:
    """A save after an odd step installs the update in flight and applies the pending sum at once (the file's
    parameters have seen every gradient), and the rule's cycle starts again, as in a run resumed from that file."""
    got, record, trainer = _strategy_run(2, tmp_path, checkpoints=True)
    saved = _replay(record, split=True, saved_after=frozenset({3}))
    assert (
        len(_differences(saved, _replay(record, split=True))) > 0
    )  # the save moves the run: the check can fail
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "epoch=0-step=3.ckpt",
        "epoch=0-step=6.ckpt",
    ]
    assert _differences(got, saved) == []
    rows, chosen = _row_counts(got)
    # Flushes at steps 2 and 5 (the cycle restarted after 3), the pending rows at the saves after 3 and 6.
    assert _deferred_update(trainer).rows_deferred == 4 * (rows - chosen)


@pytest.mark.timeout(300)
def test_under_a_schedule_a_settle_applies_the_last_summed_steps_learning_rate(tmp_path: Path) -> None:
    """A learning rate that falls every step: each step's rows at its own rate, a flush at its step's, and a settle
    (the save after step 3, the end of fit) at the rate of the last step it sums, not at the one the scheduler set
    for the next step (the negative control: replayed so, the run misses it)."""
    got, record, _ = _strategy_run(2, tmp_path, checkpoints=True, scheduled=True)
    assert record["lrs"] == pytest.approx([1e-2 * _decay(k) for k in range(STEPS)])
    saved = _replay(record, split=True, saved_after=frozenset({3}))
    assert _differences(got, saved) == []
    after_the_scheduler = _replay(
        record, split=True, saved_after=frozenset({3}), settle_lr=lambda k: 1e-2 * _decay(k)
    )
    assert len(_differences(got, after_the_scheduler)) > 0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_ranks_choose_over_the_whole_matrix(tmp_path: Path) -> None:
    """ZeRO-3 on two ranks: each holds half of each matrix's rows, and the rows chosen are those of the whole matrix
    (a rank choosing among its own rows would pick a quarter of its half and differ from the replay)."""
    from tests.distributed.cases import Case, StrategySpec
    from tests.distributed.harness import run_cases

    path = str(tmp_path / "gradients.pt")
    strategy = StrategySpec(
        "lightning_parallel:HybridParallelStrategy",
        {"zero_stage": 3, "offload": "cpu", "offload_update": RULE, "timeout": 60},
    )
    case = Case(
        "zero3_cpu_importance_dp2_nanogpt", "nanogpt", strategy, world_size=2, steps=STEPS,
        model_kwargs={"optimizer": "adamw", "learning_rate": 1e-2}, data="learnable",
        callbacks=(StrategySpec("tests.zero.gradient_capture:GradientCapture", {"path": path}),),
    )  # fmt: skip
    result = run_cases([case])[case.name]
    record = torch.load(path)
    # The harness reads the parameters in on_train_end: step 6's update in flight is not installed yet.
    split, exact = _replay(record, split=True, ended=False), _replay(record, split=False)
    matrices = [n for n, p in split.items() if p.ndim >= 2]
    assert set(matrices) <= set(_differences(split, exact))
    assert _differences(_replay(record, split=True, ended=False, shards=2), split)  # choosing per rank: apart
    assert _differences(result.params, split) == []
    rows, chosen = _row_counts(result.params)
    assert result.engagement["rows_at_once"] == STEPS * chosen  # summed over the ranks: each matrix's k rows
    assert result.engagement["rows_deferred"] == (STEPS // RULE.update_interval - 1) * (rows - chosen)


def test_tensor_parallel_is_refused_at_construction() -> None:
    """Rows cut over tensor ranks (fused q|k|v strided) are not handled: a clear error before any process starts,
    so that no rank meets it while another loads DeepSpeed's CPU Adam (a rank killed there leaves torch's build
    lock behind, and every later load waits on it). Negative control: without tensor parallelism it constructs."""
    from lightning_parallel import HybridParallelStrategy

    with pytest.raises(ValueError, match=r"`offload_update=ImportanceSplit\(.*\)` with `tensor_parallel=2`"):
        HybridParallelStrategy(zero_stage=3, offload="cpu", offload_update=RULE, tensor_parallel=2)
    HybridParallelStrategy(zero_stage=3, offload="cpu", offload_update=RULE)
