"""Pipeline timeline: bubble fraction, the PNG, and the callback on real ``torch.distributed.pipelining``.

The pure functions are checked on hand-made spans whose answer is known. The callback is checked
twice: in-process on stand-in stages (wrapping, labelling, restoring, writing), and on two gloo
processes running real schedules (1F1B with one stage per rank, ZBV zero-bubble with two), its
hooks called directly with a stand-in trainer as the pipeline strategy would expose it.
"""

from __future__ import annotations

import json
import pickle
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_parallel.pipeline.timeline import PipelineTimeline, Span, bubble_fraction, render_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def _gpipe_two_ranks() -> list[Span]:
    """GPipe, 2 ranks, 2 microbatches, forward 1 unit, backward 2: bubble (p-1)/(m+p-1) = 1/3."""
    return [
        Span(0, 0, 0, "forward", 0, 1), Span(0, 0, 1, "forward", 1, 2),
        Span(1, 1, 0, "forward", 1, 2), Span(1, 1, 1, "forward", 2, 3),
        Span(1, 1, 0, "backward", 3, 5), Span(1, 1, 1, "backward", 5, 7),
        Span(0, 0, 0, "backward", 5, 7), Span(0, 0, 1, "backward", 7, 9),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Pure functions


@pytest.mark.timeout(30)
def test_bubble_fraction_gpipe_layout() -> None:
    assert bubble_fraction(_gpipe_two_ranks()) == pytest.approx(1 / 3)


@pytest.mark.timeout(30)
def test_bubble_fraction_is_shift_invariant_and_zero_when_always_busy() -> None:
    shifted = [
        Span(s.rank, s.stage, s.microbatch, s.kind, s.start + 100, s.end + 100) for s in _gpipe_two_ranks()
    ]
    assert bubble_fraction(shifted) == pytest.approx(1 / 3)
    busy = [Span(r, r, 0, "forward", 0, 1) for r in range(3)] + [
        Span(r, r, 0, "backward", 1, 3) for r in range(3)
    ]
    assert bubble_fraction(busy) == pytest.approx(0.0)


@pytest.mark.timeout(30)
def test_bubble_fraction_counts_overlap_once_and_idle_ranks() -> None:
    overlapping = [
        Span(0, 0, 0, "forward", 0, 2),
        Span(0, 0, 1, "forward", 1, 3),
        Span(0, 0, 2, "forward", 3, 4),
    ]
    assert bubble_fraction(overlapping) == pytest.approx(0.0)
    # A second rank that recorded nothing is idle all along.
    assert bubble_fraction(overlapping, num_ranks=2) == pytest.approx(0.5)


@pytest.mark.timeout(30)
def test_bubble_fraction_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one span"):
        bubble_fraction([])
    with pytest.raises(ValueError, match="no extent"):
        bubble_fraction([Span(0, 0, 0, "forward", 1, 1)])
    with pytest.raises(ValueError, match="num_ranks"):
        bubble_fraction(_gpipe_two_ranks(), num_ranks=1)


@pytest.mark.timeout(30)
def test_render_timeline_writes_png(tmp_path: Path) -> None:
    path = render_timeline(_gpipe_two_ranks(), tmp_path / "sub" / "gpipe.png", title="GPipe 2x2")
    assert path == tmp_path / "sub" / "gpipe.png"
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    # Several stages on a rank (stage-prefixed labels), zero-bubble kinds, an empty lane.
    spans = [
        Span(0, 0, 0, "forward", 0, 1),
        Span(0, 3, 0, "backward_input", 1, 2),
        Span(0, 3, 0, "weight", 2, 3),
    ]
    data = render_timeline(spans, tmp_path / "v.png", num_ranks=2).read_bytes()
    assert data.startswith(PNG_MAGIC)


# ---------------------------------------------------------------------------------------------
# The callback in one process, on stand-in stages


class _FakeClock:
    """Stands in for ``time.perf_counter`` in the timeline module: time moves only when a stage computes."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


class _FakeStage:
    """The three compute methods of a ``PipelineStage``, with torch 2.13's signatures; each takes a known
    time on the fake clock (forward 2, backward 2, weight 1), so the spans are exact."""

    def __init__(self, stage_index: int, clock: _FakeClock | None = None) -> None:
        self.stage_index = stage_index
        self.calls: list[str] = []
        self.clock = clock or _FakeClock()

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):  # noqa: ANN001
        self.clock.now += 2
        self.calls.append(f"f{fwd_chunk_id}")
        return fwd_chunk_id

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):  # noqa: ANN001
        self.clock.now += 2
        self.calls.append(f"b{bwd_chunk_id}")

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):  # noqa: ANN001
        self.clock.now += 1
        self.calls.append(f"w{bwd_chunk_id}")


class _LogStub:
    def __init__(self) -> None:
        self.logged: dict[str, tuple[float, dict[str, Any]]] = {}

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        self.logged[name] = (value, kwargs)


def _trainer(global_step: int, stages: list[Any], group: Any = None, global_rank: int = 0) -> SimpleNamespace:
    strategy = SimpleNamespace(pipeline_stages=stages, pipeline_group=group)
    return SimpleNamespace(global_step=global_step, global_rank=global_rank, strategy=strategy)


@pytest.mark.timeout(30)
def test_callback_single_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_parallel.pipeline import timeline

    clock = _FakeClock()
    monkeypatch.setattr(timeline, "time", clock)  # the recorder's stamps read the fake clock
    stages = [_FakeStage(0, clock), _FakeStage(1, clock)]
    callback = PipelineTimeline(step=2, path=tmp_path / "t.png", json_path=tmp_path / "t.json")
    module = _LogStub()

    callback.on_train_batch_start(_trainer(1, stages), module, None, 0)  # not the step: nothing wrapped
    assert "forward_one_chunk" not in vars(stages[0])

    callback.on_train_batch_start(_trainer(2, stages), module, None, 0)
    assert "forward_one_chunk" in vars(stages[0])
    stages[0].forward_one_chunk(0, ())
    stages[1].forward_one_chunk(fwd_chunk_id=0, args=())
    stages[1].backward_one_chunk(0, None, False)  # input gradients only, positionally
    stages[1].backward_weight_one_chunk(0, last_backward=True)
    stages[0].backward_one_chunk(0, loss=None, full_backward=True)
    callback.on_train_batch_end(_trainer(3, stages), module, None, None, 0)

    for stage in stages:  # the classes' methods are back, and the originals really ran
        assert not set(_METHODS) & set(vars(stage))
    assert stages[0].calls == ["f0", "b0"] and stages[1].calls == ["f0", "b0", "w0"]
    assert [(s.stage, s.microbatch, s.kind) for s in callback.spans] == [
        (0, 0, "forward"), (1, 0, "forward"), (1, 0, "backward_input"), (1, 0, "weight"), (0, 0, "backward"),
    ]  # fmt: skip
    assert [(s.start, s.end) for s in callback.spans] == [(0, 2), (2, 4), (4, 6), (6, 7), (7, 9)]
    assert all(s.rank == 0 for s in callback.spans)
    assert callback.bubble_fraction == 0.0  # one rank, calls back to back
    value, kwargs = module.logged["pipeline_bubble_fraction"]
    assert value == callback.bubble_fraction and kwargs["sync_dist"] is False
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC)
    payload = json.loads((tmp_path / "t.json").read_text())
    assert payload["bubble_fraction"] == callback.bubble_fraction and len(payload["spans"]) == 5

    # Recorded once: a later batch at the same global step (gradient accumulation) is left alone.
    callback.on_train_batch_start(_trainer(2, stages), module, None, 1)
    assert "forward_one_chunk" not in vars(stages[0])


@pytest.mark.timeout(30)
def test_callback_restores_on_exception_and_skips_without_stages(tmp_path: Path) -> None:
    stage = _FakeStage(0)
    callback = PipelineTimeline(step=0, path=tmp_path / "t.png")
    callback.on_train_batch_start(_trainer(0, [stage]), _LogStub(), None, 0)
    assert "backward_one_chunk" in vars(stage)
    callback.on_exception(None, None, RuntimeError("boom"))
    assert "backward_one_chunk" not in vars(stage)

    plain = SimpleNamespace(global_step=0, global_rank=0, strategy=SimpleNamespace())
    callback = PipelineTimeline(step=0, path=tmp_path / "none.png")
    with pytest.warns(UserWarning, match="pipeline_stages"):
        callback.on_train_batch_start(plain, _LogStub(), None, 0)
    callback.on_train_batch_end(plain, _LogStub(), None, None, 0)
    assert callback.spans is None and not (tmp_path / "none.png").exists()


# ---------------------------------------------------------------------------------------------
# Two processes, real schedules over gloo

MICROBATCHES = 4
WORLD = 2


def _chunk(stage_index: int, num_stages: int) -> torch.nn.Module:
    torch.manual_seed(stage_index)
    width = 64
    if stage_index == num_stages - 1:
        return torch.nn.Sequential(torch.nn.Linear(width, 8))
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())


def _run_schedule(name: str, rank: int, group: Any, out: Path) -> dict[str, Any]:
    """Two steps of the schedule ``name``, the second one recorded; what the callback saw."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    from lightning_parallel.compat import without_sends_to_self

    class Stage(PipelineStage):
        def _get_init_p2p_neighbors_ops(self) -> list[Any]:  # torch 2.11, V layout: no pair to itself
            return without_sends_to_self(super()._get_init_p2p_neighbors_ops())

    if name == "1f1b":
        num_stages, indices = WORLD, [rank]
    else:  # V layout: rank r holds stages r and 2W-1-r
        num_stages, indices = 2 * WORLD, [rank, 2 * WORLD - 1 - rank]
    stages = [Stage(_chunk(i, num_stages), i, num_stages, torch.device("cpu"), group=group) for i in indices]
    loss_fn = torch.nn.MSELoss()
    if name == "1f1b":
        schedule = Schedule1F1B(stages[0], n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    else:
        schedule = ScheduleZBVZeroBubble(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    callback = PipelineTimeline(step=1, path=out / f"{name}.png")
    module = _LogStub()
    generator = torch.Generator().manual_seed(0)
    for step in range(2):
        x = torch.randn(8 * MICROBATCHES, 64, generator=generator)
        y = torch.randn(8 * MICROBATCHES, 8, generator=generator)
        trainer = _trainer(step, stages, group, global_rank=rank)
        callback.on_train_batch_start(trainer, module, None, step)
        inputs = (x,) if any(s.is_first for s in stages) else ()
        schedule.step(*inputs, target=y if any(s.is_last for s in stages) else None)
        callback.on_train_batch_end(
            _trainer(step + 1, stages, group, global_rank=rank), module, None, None, step
        )
    return {
        "spans": callback.spans,
        "bubble": callback.bubble_fraction,
        "logged": module.logged,
        "rank": rank,
        "stage_indices": indices,
        "restored": all(not set(vars(s)) & set(_METHODS) for s in stages),
    }


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        group = dist.new_group(list(range(WORLD)))
        out = Path(out_dir)
        results = {name: _run_schedule(name, rank, group, out) for name in ("1f1b", "zbv")}
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Both schedules in one launch of two spawned processes (start-up is most of the cost)."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("timeline")
    context = mp.start_processes(_worker, args=(str(out / "pg_init"), str(out)), nprocs=WORLD, join=False,
                                 start_method="spawn")  # fmt: skip
    deadline = time.monotonic() + 100
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("two-rank pipeline run timed out")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return out, [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def _check_lanes(results: list[dict[str, Any]]) -> list[Span]:
    """Every rank gathered the same spans; on each rank they are sequential; the value was logged."""
    spans = results[0]["spans"]
    for result in results:
        assert result["spans"] == spans and result["bubble"] == results[0]["bubble"]
        assert 0 < result["bubble"] < 1
        assert result["logged"]["pipeline_bubble_fraction"][0] == result["bubble"]
        assert result["restored"]
    for rank in range(WORLD):
        lane = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start)
        assert lane, f"rank {rank} recorded nothing"
        for before, after in zip(lane, lane[1:], strict=False):
            assert before.end <= after.start, f"overlap on rank {rank}: {before} {after}"
    return spans


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_1f1b(two_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    out, results = two_ranks
    spans = _check_lanes([r["1f1b"] for r in results])
    for rank in range(WORLD):
        kinds = [s.kind for s in spans if s.rank == rank]
        assert kinds.count("forward") == MICROBATCHES and kinds.count("backward") == MICROBATCHES
        assert len(kinds) == 2 * MICROBATCHES
        assert {s.stage for s in spans if s.rank == rank} == {rank}
        assert sorted(s.microbatch for s in spans if s.rank == rank and s.kind == "forward") == [0, 1, 2, 3]
    assert (out / "1f1b.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_zero_bubble_v(two_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    out, results = two_ranks
    spans = _check_lanes([r["zbv"] for r in results])
    for rank in range(WORLD):
        assert {s.stage for s in spans if s.rank == rank} == {rank, 2 * WORLD - 1 - rank}
    for stage in range(2 * WORLD):
        kinds = [s.kind for s in spans if s.stage == stage]
        assert kinds.count("forward") == MICROBATCHES
        assert kinds.count("backward") + kinds.count("backward_input") == MICROBATCHES
        assert kinds.count("weight") == kinds.count("backward_input")
    assert any(s.kind == "backward_input" for s in spans) and any(s.kind == "weight" for s in spans)
    assert (out / "zbv.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.timeout(60)
def test_callback_in_a_real_trainer(tmp_path: Path) -> None:
    """Lightning accepts the callback's ``log`` from ``on_train_batch_end``; the step counted is global_step."""
    import lightning as L
    from lightning.pytorch.strategies import SingleDeviceStrategy

    stage = _FakeStage(0)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            stage.forward_one_chunk(batch_idx, ())
            stage.backward_one_chunk(batch_idx)
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    strategy.pipeline_stages = [stage]
    strategy.pipeline_group = None
    callback = PipelineTimeline(step=2, path=tmp_path / "t.png")
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    trainer = L.Trainer(strategy=strategy, callbacks=[callback], max_steps=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Module(), data)
    assert [(s.microbatch, s.kind) for s in callback.spans] == [(2, "forward"), (2, "backward")]
    assert float(trainer.callback_metrics["pipeline_bubble_fraction"]) == pytest.approx(
        callback.bubble_fraction
    )
    assert (tmp_path / "t.png").exists() and "forward_one_chunk" not in vars(stage)
