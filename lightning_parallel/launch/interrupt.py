"""Ctrl+C that every rank obeys at the same step boundary, so the checkpoint it leads to resumes exactly.

A ``KeyboardInterrupt`` lands on each rank wherever that rank is: one inside a gradient all-reduce,
another still in its forward, a third not signalled at all (a ``kill -INT`` of one rank). Lightning
then runs ``on_exception`` (``OnExceptionCheckpoint`` saves: a collective), and ranks in different
places issue mismatched collectives: a hang, or a checkpoint of a state no step boundary had.

:class:`AgreedInterrupt` turns the first ``SIGINT`` a rank receives into a stop step written in
the process group's store (the first writer wins): two optimizer steps after the signalled rank's
step. Every rank reads the store at the start of each batch (no collective: one store request) and
raises ``KeyboardInterrupt`` itself at the start of that step, all at the same point, before the
batch trains, the point an exception checkpoint resumes exactly from. Two steps are enough: a rank
cannot finish a step before every other rank has reached it (each step ends in collectives that
join the ranks), so no rank passes the stop step before the store holds it. A second ``SIGINT``
on a rank interrupts it at once, as without this.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch.distributed as dist

from lightning_parallel.compat import default_store

STOP_MARGIN = 2  # steps between the signal and the common stop


class AgreedInterrupt:
    """Installed for one ``fit`` (its ``index`` keys the store, so a later fit starts clean)."""

    def __init__(self, index: int) -> None:
        self.key = f"lightning_parallel/interrupt/{index}"
        self.step = 0  # the step the training loop is at, as the handler reads it
        self._previous: Any = None
        self._stop_at: int | None = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers live on the main thread only
        self._previous = signal.signal(signal.SIGINT, self._on_signal)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous)
        self._installed = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        # The next Ctrl+C is the user's own: back to the handler that was there (KeyboardInterrupt).
        signal.signal(signal.SIGINT, self._previous)
        self._installed = False
        wanted = str(self.step + STOP_MARGIN)
        store = _store()
        if store is None:
            self._stop_at = int(wanted)
            return
        self._stop_at = int(store.compare_set(self.key, "", wanted))  # the first rank's stop step wins
        print(
            f"lightning_parallel: Ctrl+C; every rank stops at step {self._stop_at} (press again to stop now)",
            flush=True,
        )

    def check(self, step: int) -> None:
        """At the start of a batch: raise ``KeyboardInterrupt`` on every rank at the agreed step."""
        self.step = step
        if self._stop_at is None:
            store = _store()
            if store is not None and store.check([self.key]):
                self._stop_at = int(store.get(self.key))
        if self._stop_at is not None and step >= self._stop_at:
            raise KeyboardInterrupt(f"stopped at step {step} after Ctrl+C (every rank at the same step)")


_FITS = [
    0
]  # fits started in this process: every rank starts the same fits, so the count keys the store alike


def start_agreed_interrupt() -> AgreedInterrupt:
    """An :class:`AgreedInterrupt` for the fit that starts now, installed."""
    _FITS[0] += 1
    interrupt = AgreedInterrupt(_FITS[0])
    interrupt.install()
    return interrupt


def _store() -> Any:
    """The default process group's key-value store (None outside a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return default_store()
