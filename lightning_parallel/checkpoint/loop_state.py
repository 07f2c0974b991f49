"""A checkpoint of an epoch that ``max_steps`` (or ``should_stop``) cut short resumes inside that epoch.

When ``fit`` stops at ``max_steps`` in the middle of an epoch, Lightning closes the epoch anyway:
its fit loop counts the epoch as processed and completed. A checkpoint taken then
(``trainer.save_checkpoint(path)`` after ``fit`` returned, or ``ModelCheckpoint`` at
``on_train_epoch_end``/``on_train_end``) therefore tells the resumed run that the epoch is over,
and it starts the next one from its first batch, skipping the rest of the data: a continued run
(``fit(ckpt_path=path)`` with a larger ``max_steps``) no longer follows the uninterrupted one.
A checkpoint taken at ``on_train_batch_end`` of the same step (``ModelCheckpoint``'s default)
resumes exactly; :func:`reopen_cut_epoch` makes the other paths write what it writes: the epoch
counted as started but not processed, so Lightning restarts mid-epoch after the last finished
batch (and the resumable loader, ``checkpoint/dataloader.py``, continues with the next batch).
"""

from __future__ import annotations

import copy
from typing import Any

from lightning_parallel.checkpoint.dataloader import ResumableDataLoaderMixin

__all__ = ["loader_states", "reopen_cut_epoch"]


def loader_states(trainer: Any) -> list[Any] | None:
    """The training loaders' own states as the current batch left them (what a save at its end would hold).

    Lightning resets its loaders when ``fit`` ends, so a loader that keeps its position itself (torchdata's
    ``StatefulDataLoader``) is saved after ``fit`` as a fresh iteration; :func:`reopen_cut_epoch` puts this
    state back instead.
    """
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    if combined is None or not any(_keeps_own_state(loader) for loader in combined.flattened):
        return None  # no such loader: nothing to take (and no state_dict call, which may be a collective)

    return copy.deepcopy(combined._state_dicts())


def _keeps_own_state(loader: Any) -> bool:
    """A loader that saves its position itself, other than the strategy's resumable loaders
    (``checkpoint/dataloader.py``: their state is rebuilt from Lightning's progress, and taking it gathers
    the ranks' random states)."""
    return callable(getattr(loader, "state_dict", None)) and not isinstance(loader, ResumableDataLoaderMixin)


def reopen_cut_epoch(checkpoint: dict[str, Any], last_loader_states: list[Any] | None = None) -> bool:
    """Mark an epoch that stopped before its last batch as still running, in place; whether it did.

    ``last_loader_states``: :func:`loader_states` at the epoch's last batch, for the loaders' entry.
    """
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(fit_loop, dict):
        return False
    epochs = fit_loop.get("epoch_progress", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    current = epochs.get("current", {})
    if not current or batches.get("is_last_batch", True):
        return False  # the epoch ran to its last batch (or nothing is known): nothing to reopen
    batch = batches.get("current", {})
    if not batch.get("completed") or current.get("processed") != current.get("ready"):
        return False  # saved inside the epoch (processed = ready - 1): already what resumes exactly
    for counts in (epochs["current"], epochs["total"]):
        counts["processed"] = counts["completed"] = counts["ready"] - 1
    checkpoint["epoch"] = epochs["current"]["completed"]
    state = fit_loop.get("state_dict")
    if last_loader_states is not None and isinstance(state, dict) and "combined_loader" in state:
        state["combined_loader"] = last_loader_states
    return True
