"""Memory-efficient optimizers usable from an ordinary ``configure_optimizers``.

- :class:`Adafactor` is ``torch.optim.Adafactor`` (factored second moments: a row and a column
  vector per weight matrix instead of a full matrix, no first moment) made to step DTensor
  parameters too (torch's own fails on them under ``tensor_parallel``; see :mod:`.adafactor`).
- :func:`low_bit_adamw`: AdamW with 8-bit, 4-bit or fp8 optimizer states from torchao (an
  optional dependency: ``pip install --no-deps torchao``, which never touches torch).
- :func:`optimizer_state_bytes`: bytes an optimizer's state holds (this process's shards).

ZeRO sharding of optimizer states is not in this version (``zero_stage`` is refused); these
optimizers shrink the state itself, on every layout that is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor

from lightning_parallel.optim.adafactor import Adafactor

__all__ = ["Adafactor", "low_bit_adamw", "optimizer_state_bytes", "tensor_bytes"]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds on this process: a DTensor's local shard, a tensor subclass's inner tensors."""
    if isinstance(tensor, DTensor):
        return tensor_bytes(tensor.to_local())
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if (
        flatten is not None
        and type(tensor) is not torch.Tensor
        and not isinstance(tensor, torch.nn.Parameter)
    ):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes in ``optimizer.state`` (moments, factors, step counters), as held on this process."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += tensor_bytes(value)
    return total


def low_bit_adamw(
    params: Iterable[Any],
    bits: Literal[8, 4, "fp8"] = 8,
    compile: bool | None = None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8``: block-quantized first and second moments.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        bits: ``8`` (about 1/4 of AdamW's state), ``4`` (about 1/8) or ``"fp8"``.
        compile: torchao compiles its update with ``torch.compile``. That is fast on a GPU, but
            on a CPU inductor's first compilation takes minutes; ``None`` compiles only when a
            parameter is on a GPU (elsewhere the update runs eagerly, same numbers).
        kwargs: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``block_size``, ... (torchao's).
    """
    try:
        from torchao import optim as ao_optim
    except ImportError as error:
        raise ImportError(
            "low_bit_adamw needs torchao: `pip install --no-deps torchao` (--no-deps keeps your torch build)."
        ) from error
    classes = {8: ao_optim.AdamW8bit, 4: ao_optim.AdamW4bit, "fp8": ao_optim.AdamWFp8}
    if bits not in classes:
        raise ValueError(f"`bits={bits!r}` must be 8, 4 or 'fp8'.")
    params = list(params)
    optimizer = classes[bits](params, **kwargs)
    if compile is None:
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        compile = any(p.device.type == "cuda" for p in tensors)
    if not compile:
        step = optimizer.step

        def eager_step(*args: Any, **kw: Any) -> Any:
            with torch.compiler.set_stance("force_eager"):
                return step(*args, **kw)

        optimizer.step = eager_step  # type: ignore[method-assign]
    return optimizer
