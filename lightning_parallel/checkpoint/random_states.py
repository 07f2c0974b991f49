"""Lightning's random states in a form a checkpoint's metadata can hold, and back.

Lightning saves rank 0's RNG only; the strategy gathers every rank's (dropout masks and random
samplers differ per rank), and ``torch.load(weights_only=True)``, Lightning's default for the
metadata file, refuses numpy objects, so numpy's state travels as a tensor.
"""

from __future__ import annotations

from typing import Any

import torch


def portable_rng_states(states: dict[str, Any]) -> dict[str, Any]:
    """Lightning's random states with numpy's array as a tensor: ``torch.load(weights_only=True)``,
    Lightning's default for a checkpoint's metadata, refuses numpy objects."""
    out = dict(states)
    if "numpy" in out:
        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (
            str(name),
            torch.from_numpy(keys.astype("int64")),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    return out


def native_rng_states(states: dict[str, Any]) -> dict[str, Any]:
    out = dict(states)
    if "numpy" in out:
        import numpy as np

        name, keys, pos, has_gauss, cached = out["numpy"]
        out["numpy"] = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
    if "torch.cuda" in out and not torch.cuda.is_available():
        del out["torch.cuda"]
    return out
