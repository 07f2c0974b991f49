"""CUDA-only checks of the libraries under the strategy, made to see the CPU, so that the GPU's behaviour happens here.

Issue 33: DeepSpeed's ``engine.forward`` runs the module inside ``autocast_if_enabled``
(``deepspeed/runtime/torch_autocast.py``), which switches an autocast entered outside the engine
off unless the config has a ``torch_autocast`` section. Its test is ``torch.is_autocast_enabled()``
without a device, which sees only CUDA's autocast: on the CPU it never fired, the CPU runs kept
Lightning's autocast, and every CPU test passed while a GPU ran the whole step in fp32.

:func:`gpu_checks_on_the_cpu` gives that module a ``torch`` whose ``is_autocast_enabled()`` (no
device) answers for the CPU, as it answers for CUDA on a GPU; everything else is torch's. The
harness applies it in every worker and reference process, around every case
(``Case.gpu_checks``). The other checks on the ZeRO, context- and data-parallel paths were read
(DeepSpeed 0.19.8, torch 2.13, Lightning 2.6.6) and ask for the device they act on: DeepSpeed's
ZeRO-3 linear and its ``torch.autocast`` calls use the accelerator's device name (``cpu`` here),
``torch.utils.checkpoint`` records the CPU's autocast state beside the device's, FSDP2, DDP and
torch's context parallelism read no autocast state, and this project's own calls pass the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SeesCpuAutocast", "gpu_checks_on_the_cpu", "patched_modules"]


class SeesCpuAutocast:
    """``torch``, except that ``is_autocast_enabled()`` without a device answers for the CPU (as for CUDA on a GPU)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def is_autocast_enabled(device_type: str | None = None) -> bool:
        return torch.is_autocast_enabled("cpu" if device_type is None else device_type)


# Modules whose module-level ``torch`` is swapped: each calls ``torch.is_autocast_enabled()`` without a device.
_MODULES = ("deepspeed.runtime.torch_autocast",)


def patched_modules() -> list[str]:
    """The modules whose ``torch`` sees the CPU's autocast right now."""
    import importlib

    return [name for name in _MODULES if isinstance(importlib.import_module(name).torch, SeesCpuAutocast)]


@contextlib.contextmanager
def gpu_checks_on_the_cpu(enabled: bool = True) -> Iterator[list[str]]:
    """Within: the CUDA-only checks see the CPU (``enabled=False``: as shipped); yields the modules patched."""
    import importlib

    modules = [importlib.import_module(name) for name in _MODULES]
    saved = [module.torch for module in modules]
    try:
        for module in modules:
            module.torch = SeesCpuAutocast() if enabled else torch
        yield patched_modules()
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.torch = original
