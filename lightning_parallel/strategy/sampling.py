"""The user's own step on the first batch of the current stage, for the one sampled step at setup.

The plan verification needs the exact arguments a transformer block gets (hidden states,
masks, rotary embeddings, ...) and the pipeline cut needs to watch one step; only the user's
own step knows how to produce them. This is the Lightning side: the first batch of the
dataloader of the current stage (read once) and the matching ``*_step``, with logging silenced
(no loop is running yet, and nothing must be logged) and metric states left as they were. The
recipe runs it (``parallelize/sample.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics import Metric

from lightning_parallel.parallelize.sample import SampledStep

if TYPE_CHECKING:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import Strategy

_LOOP_AND_STEP = {
    TrainerFn.FITTING: ("fit_loop", "training_step"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step"),
    TrainerFn.TESTING: ("test_loop", "test_step"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step"),
}


def _first_batch(loader: Any) -> Any:
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    return next(iter(loader))


def _metric_states(module: Any) -> list[tuple[Any, dict[str, Any]]]:
    """Snapshot the torchmetrics states a step may update (``self.val_ppl(logits, y)``): the sample
    step must leave no trace in what the first real epoch reports."""
    saved = []
    for metric in module.modules():
        if isinstance(metric, Metric):
            state = {name: _clone(getattr(metric, name)) for name in metric._defaults}
            state["_update_count"] = metric._update_count
            state["_computed"] = metric._computed
            saved.append((metric, state))
    return saved


def _clone(value: Any) -> Any:
    if isinstance(value, list):
        return [v.clone() for v in value]
    return value.clone() if hasattr(value, "clone") else value


def _restore_metric_states(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    for metric, state in saved:
        for name, value in state.items():
            setattr(metric, name, value)


def first_batch(trainer: Trainer, strategy: Strategy) -> Any | None:
    """The first batch of the current stage's dataloader, on the device; None if there is no data."""
    loop_name, _ = _LOOP_AND_STEP.get(trainer.state.fn, ("fit_loop", "training_step"))
    source = getattr(getattr(trainer, loop_name, None), "_data_source", None)
    if source is None or not source.is_defined():
        return None
    try:
        return strategy.batch_to_device(_first_batch(source.dataloader()))
    except (StopIteration, TypeError, NotImplementedError):
        return None


def sample_step(trainer: Trainer, strategy: Strategy) -> SampledStep | None:
    """The user's step of the current stage on its first batch (read once), or None if there is no data."""
    _, step_name = _LOOP_AND_STEP.get(trainer.state.fn, ("fit_loop", "training_step"))
    batch = first_batch(trainer, strategy)
    if batch is None:
        return None
    module = strategy.lightning_module
    assert module is not None

    def run(batch: Any) -> Any:
        module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
        module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
        saved = _metric_states(module)
        try:
            return getattr(module, step_name)(batch, 0)
        finally:
            del module.log, module.log_dict
            _restore_metric_states(saved)

    return SampledStep(batch, run)
