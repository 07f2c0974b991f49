"""Every checkpoint file we read is unpickled with ``weights_only=True``: a file from elsewhere runs no code.

A pickle can name any callable to run while it loads (``__reduce__``), so ``torch.load`` of an
untrusted ``.ckpt`` with ``weights_only=False`` executes whatever its author chose. torch's
default since 2.6, and Lightning's, is the restricted unpickler; the only exception we make is
the one the user asks for by passing ``weights_only=False`` to ``Trainer.fit`` themselves.

What Lightning itself writes into a checkpoint (tensors, dicts, lists, numbers, strings, its
loops' and callbacks' states, ``hyper_parameters`` as plain values) loads under the restricted
unpickler; a class it does not know is refused with the error below, which names the class and
the two ways on.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch

__all__ = ["UnsafeCheckpointError", "load_trusted_or_weights", "size_mismatch"]


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds Python objects that loading only tensors and plain values refuses."""


def load_trusted_or_weights(
    path: str | os.PathLike, what: str, weights_only: bool | None = None, **kwargs: Any
) -> Any:
    """``torch.load(path, weights_only=True)`` unless the caller passed ``weights_only=False`` explicitly.

    ``what`` names the argument or call the path came from, for the error.
    """
    restricted = weights_only is not False
    try:
        return torch.load(path, weights_only=restricted, **kwargs)
    except (RuntimeError, EOFError) as error:  # not a file torch.save wrote (or a truncated one)
        raise ValueError(
            f"{what}: `{path}` is not a checkpoint torch can read ({type(error).__name__}: {str(error).splitlines()[0]})."
            " Pass a checkpoint folder or file that `Trainer.save_checkpoint` (or `torch.save`) wrote."
        ) from error
    except pickle.UnpicklingError as error:
        if not restricted:
            raise
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        # torch's message: a paragraph about the 2.6 default, then the line that names the global.
        first = next(
            (line for line in lines if "GLOBAL" in line or "global" in line), lines[0] if lines else ""
        )
        raise UnsafeCheckpointError(
            f"{what}: `{path}` holds Python objects beyond tensors and plain values ({first}). Unpickling"
            " them could run code from the file, so it was not loaded. If the file is yours, allow the class"
            " with `torch.serialization.add_safe_globals([TheClass])` (or pass `weights_only=False` to"
            " `Trainer.fit` for a resume); otherwise save only its tensors, e.g."
            " `torch.save(checkpoint['state_dict'], 'weights.pt')`."
        ) from error


def size_mismatch(error: BaseException) -> str | None:
    """torch.distributed.checkpoint's "Size mismatch ..." among a read failure's per-rank errors, if any."""
    failures = getattr(error, "failures", None)
    candidates = [*failures.values()] if isinstance(failures, dict) else [error]
    for candidate in candidates:
        text = str(candidate[0] if isinstance(candidate, tuple) else candidate)
        if "Size mismatch" in text:
            return text.strip().splitlines()[0]
    return None
