"""What the host updates that land after their step share (``offload_update="delayed"`` and an importance split).

Each keeps one worker thread that computes on the host while the device runs the next step, one task in flight,
and the optimizer's hyper-parameters read at the step that launched the task (a scheduler may change them
before the worker runs). The strategy talks to either through :meth:`DeferredUpdate.launch` (the optimizer's
step), :meth:`DeferredUpdate.settle` (a checkpoint, the end of ``fit``), :meth:`DeferredUpdate.wait` (before
gradients are zeroed in place) and :meth:`DeferredUpdate.close`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["HYPER_PARAMETERS", "DeferredUpdate"]

HYPER_PARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""What Adam reads from a parameter group."""


class DeferredUpdate:
    """One worker, one task in flight; subclasses say what a step launches and what settling installs."""

    def __init__(self, optimizer: Any, thread_name: str) -> None:
        self.optimizer = optimizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._in_flight: Future[Any] | None = None

    @staticmethod
    def hyper(group: dict[str, Any]) -> dict[str, Any]:
        """The group's Adam hyper-parameters now (a copy: the worker reads them later)."""
        return {k: group[k] for k in HYPER_PARAMETERS}

    def launch(self) -> None:
        raise NotImplementedError

    def settle(self) -> bool:
        """Install what is in flight or pending; whether any parameter changed."""
        raise NotImplementedError

    def wait(self) -> None:
        """Until the worker has read this step's gradients (before anything zeroes them in place)."""
        if self._in_flight is not None:
            self._in_flight.result()

    def close(self) -> bool:
        changed = self.settle()
        self._pool.shutdown(wait=True)
        return changed
