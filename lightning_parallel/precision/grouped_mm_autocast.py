"""Autocast for torch's grouped matmul, which has no autocast rule of its own.

The mixture-of-experts layers of Hugging Face models (transformers 5: Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V3 and every family built on ``transformers.integrations.moe``) compute their experts
with ``torch._grouped_mm``. torch gives that op no autocast rule (pytorch/pytorch#174763), and
transformers casts the input to the weight's dtype, so under ``bf16-mixed`` and ``16-mixed``, whose
weights stay fp32, every expert product (most of an MoE model's FLOPs) ran in fp32 while the rest
of the model ran in the low precision; on a GPU that is torch's fp32 fallback instead of its grouped
bf16 kernel. The one-process run did the same, so only the compute-dtype record could see it.

The rule registered here is the one autocast applies to ``mm``: the floating operands on the
autocast device are cast to the autocast dtype, and the product runs in it. It lives on the
dispatcher's autocast keys, so it holds wherever autocast holds: inside DeepSpeed's engine (its own
``torch.autocast``) and in the recomputation of activation checkpointing (which restores the
autocast state, not Python modes). Registered once per process when a mixed-precision plugin of this
package is built; where torch has a rule of its own for a device, torch's is kept.

The grouped kernels need every stride of 16 bytes or more: a tiny model whose widths are not a
multiple of 8 in bf16 would fail where fp32 ran, so such a product keeps its operands' dtype (as
without this rule) and is counted in :data:`KEPT_WIDE`; so does one whose kernel refuses the low
dtype (a GPU's grouped kernel without fp16, say).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from lightning_parallel.compat import below_dispatch_key, destroy_library, has_kernel_for
from lightning_parallel.memory.counting import local_tensor

__all__ = [
    "KEPT_WIDE",
    "grouped_mm_autocast_registered",
    "register_grouped_mm_autocast",
    "unregister_grouped_mm_autocast",
]

_OP = "_grouped_mm"
_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_LOW = (torch.float32, torch.float16, torch.bfloat16)
_library: torch.library.Library | None = None
_registered: set[str] = set()
_REFUSED: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) whose grouped kernel refused the dtype

KEPT_WIDE: Counter[str] = Counter()
"""Grouped products left in their operands' dtype, per device type: the low-precision copies would break the
kernel's 16-byte stride rule, or the kernel refused that dtype."""


def _aligned(tensor: torch.Tensor) -> bool:
    local = local_tensor(tensor)  # a DTensor: the kernel sees the shard
    size = local.element_size()
    return all(stride == 1 or (stride * size) % 16 == 0 for stride in local.stride())


def _rule(device_type: str) -> Any:

    def grouped_mm(
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        offs: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(device_type)

        def cast(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None or tensor.dtype not in _LOW or tensor.device.type != device_type:
                return tensor
            return tensor.to(dtype)

        with below_dispatch_key(_KEYS[device_type]):
            low_a, low_b = cast(mat_a), cast(mat_b)
            assert low_a is not None and low_b is not None
            if _aligned(low_a) and _aligned(low_b) and (device_type, dtype) not in _REFUSED:
                try:
                    return torch.ops.aten._grouped_mm(low_a, low_b, offs, cast(bias), out_dtype)
                except (torch.OutOfMemoryError, torch.AcceleratorError):
                    raise  # the device's trouble, not the dtype's
                except RuntimeError:
                    # a kernel without this dtype (fp16 on some GPUs): as torch alone computes it, from now on
                    _REFUSED.add((device_type, dtype))
            KEPT_WIDE[device_type] += 1
            return torch.ops.aten._grouped_mm(mat_a, mat_b, offs, bias, out_dtype)

    return grouped_mm


def register_grouped_mm_autocast() -> None:
    """Give ``torch._grouped_mm`` autocast's matmul rule on the CPU and CUDA (idempotent; a no-op where torch
    has no such op, or already has a rule for a device)."""
    global _library
    if not hasattr(torch.ops.aten, _OP):
        return
    for device_type, key in _KEYS.items():
        if device_type in _registered:
            continue
        if has_kernel_for(f"aten::{_OP}", key):
            continue  # torch's own rule (a later release)
        if _library is None:
            _library = torch.library.Library("aten", "IMPL")
        _library.impl(_OP, _rule(device_type), key)
        _registered.add(device_type)


def grouped_mm_autocast_registered(device_type: str) -> bool:
    """Whether this module's rule is the one autocast applies to grouped products on ``device_type``."""
    return device_type in _registered


def unregister_grouped_mm_autocast() -> None:
    """Take the rule away again: grouped products under autocast in their operands' dtype, as torch has them
    (the negative control of the compute-dtype record; a plugin built later registers it again)."""
    global _library
    if _library is not None:
        destroy_library(_library)
    _library = None
    _registered.clear()
    _REFUSED.clear()
