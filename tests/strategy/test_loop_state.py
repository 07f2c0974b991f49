"""``reopen_cut_epoch``: only an epoch that stopped before its last batch and was closed is reopened."""

from __future__ import annotations

import copy

from lightning_parallel.checkpoint.loop_state import reopen_cut_epoch


def _checkpoint(processed: int, completed: int, is_last_batch: bool, epoch: int) -> dict:
    counts = {"ready": 1, "started": 1, "processed": processed, "completed": completed}
    batches = {"ready": 3, "started": 3, "processed": 3, "completed": 3}
    return {
        "epoch": epoch,
        "loops": {"fit_loop": {
            "epoch_progress": {"total": dict(counts), "current": dict(counts)},
            "epoch_loop.batch_progress": {"total": dict(batches), "current": dict(batches), "is_last_batch": is_last_batch},
        }},
    }  # fmt: skip


def test_an_epoch_closed_by_max_steps_is_reopened_as_a_mid_epoch_checkpoint() -> None:
    after_fit = _checkpoint(processed=1, completed=1, is_last_batch=False, epoch=1)
    mid_epoch = _checkpoint(processed=0, completed=0, is_last_batch=False, epoch=0)  # ModelCheckpoint's
    assert reopen_cut_epoch(after_fit)
    assert after_fit == mid_epoch
    at_epoch_end_hook = _checkpoint(processed=1, completed=0, is_last_batch=False, epoch=0)
    assert reopen_cut_epoch(at_epoch_end_hook) and at_epoch_end_hook == mid_epoch


def test_a_finished_epoch_and_a_mid_epoch_checkpoint_are_left_alone() -> None:
    for checkpoint in (
        _checkpoint(processed=1, completed=1, is_last_batch=True, epoch=1),  # ran to its last batch
        _checkpoint(processed=0, completed=0, is_last_batch=False, epoch=0),  # already mid-epoch
        {"state_dict": {}},  # no loops (a weights-only save)
    ):
        before = copy.deepcopy(checkpoint)
        assert not reopen_cut_epoch(checkpoint)
        assert checkpoint == before
