"""The optimizer every test model family uses, in one place.

SGD with momentum by default: it is linear in the gradient, so parity with the single-process
run tests the gradients with a wide margin. AdamW (``eps=1e-5``) is available for cases that
must exercise optimizer state; see docs/testing.md, "Adam and the parameter tolerance".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

OPTIMIZERS = ("sgd", "adamw")


def parity_optimizer(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: str = "sgd",
    learning_rate: float | None = None,
    weight_decay: float = 0.1,
    adam_eps: float = 1e-5,
) -> torch.optim.Optimizer:
    """SGD (lr 0.1, momentum 0.9) or AdamW (lr 1e-3); ``learning_rate`` overrides the default."""
    if optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=0.1 if learning_rate is None else learning_rate, momentum=0.9)
    if optimizer == "adamw":
        lr = 1e-3 if learning_rate is None else learning_rate
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, eps=adam_eps)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
