"""fp8 training through torchao's float8 linear layers, on GPUs that have fp8 matmuls.

Lightning's ``Trainer(precision=...)`` accepts a fixed set of strings ("fp8" is not one of
them), so fp8 is a plugin::

    from lightning_parallel.precision.fp8 import Float8Precision
    trainer = L.Trainer(plugins=[Float8Precision()], strategy=HybridParallelStrategy(...))

It is bf16 autocast (:class:`HybridMixedPrecision`) plus torchao's
``convert_to_float8_training``: every ``nn.Linear`` whose dimensions are multiples of 16
becomes a ``Float8Linear`` (matmul inputs cast to float8 e4m3 with dynamic per-tensor scales,
gradients in e5m2; parameters and optimizer stay in fp32). Module names and state-dict keys
are unchanged (the conversion swaps classes, not names).

Refused, with the reason, at construction: hardware without fp8 matmuls (any CPU, NVIDIA GPUs
before compute capability 8.9: fp8 tensor cores arrived with Ada and Hopper) and a missing
torchao. With ``tensor_parallel > 1`` the ``Float8Linear`` layers are sharded by the ordinary
plan (torchao's float8 works on DTensor weights; the collectives stay in high precision),
checked in emulation against one process, under data and tensor + sequence parallelism, by the
measured low-precision rule (``tests/distributed/test_parity_fp8.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_parallel.precision.plugin import HybridMixedPrecision

__all__ = ["Float8Precision", "fp8_supported"]

MIN_CAPABILITY = (8, 9)


def fp8_supported(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether ``device`` (default: the current CUDA device) has fp8 matmuls, and why not."""
    if not torch.cuda.is_available():
        return (
            False,
            "no CUDA device is available (fp8 matmuls need an NVIDIA GPU; this is a CPU-only machine)",
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return False, (
            f"{name} has compute capability {capability[0]}.{capability[1]}; fp8 matmuls need"
            f" {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)"
        )
    return True, ""


def _default_filter(module: nn.Module, name: str) -> bool:
    # torch._scaled_mm needs both matmul dimensions divisible by 16.
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


class Float8Precision(HybridMixedPrecision):
    """bf16 autocast with float8 linear layers (torchao), for GPUs with fp8 matmuls.

    Args:
        recipe: torchao's float8 recipe: ``"tensorwise"`` (default, fastest), ``"rowwise"``
            or ``"rowwise_with_gw_hp"`` (more accurate scaling).
        module_filter: ``(module, fully qualified name) -> bool``: which ``nn.Linear`` layers to
            convert (default: those whose dimensions are multiples of 16; keep the output head
            in bf16 by returning False for its name if the loss suffers).
        device: the CUDA device to check (default: the current one).
        emulate: torchao's emulation: fp8 rounding of the matmul inputs with the matmuls in
            higher precision, on any device (a CPU too). For testing the plumbing without fp8
            hardware; never faster than bf16.
    """

    def __init__(
        self,
        recipe: str = "tensorwise",
        module_filter: Callable[[nn.Module, str], bool] | None = None,
        device: torch.device | str | None = None,
        *,
        emulate: bool = False,
    ) -> None:
        supported, reason = fp8_supported(device)
        if not supported and not emulate:
            raise ValueError(
                f"Float8Precision (precision 'fp8'): {reason}. Use `Trainer(precision='bf16-mixed')` on this"
                " hardware; fp8 training runs on NVIDIA GPUs of compute capability 8.9 or newer (H100, H200)."
            )
        try:
            from torchao.float8 import Float8LinearConfig  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "Float8Precision needs torchao: `pip install --no-deps torchao` (--no-deps keeps your torch build)."
            ) from error
        super().__init__("bf16-mixed", "cuda" if supported or torch.cuda.is_available() else "cpu")
        self.recipe = recipe
        self.emulate = emulate
        self.module_filter = module_filter or _default_filter
        self.converted: list[str] = []

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the selected ``nn.Linear`` layers for torchao's ``Float8Linear`` (names unchanged)."""
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        if self.emulate:
            config = dataclasses.replace(config, emulate=True)

        def keep(child: nn.Module, name: str) -> bool:
            chosen = self.module_filter(child, name)
            if chosen and isinstance(child, nn.Linear):
                self.converted.append(name)
            return chosen

        convert_to_float8_training(module, config=config, module_filter_fn=keep)
        return super().convert_module(module)

    def describe(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "emulate": self.emulate, "float8_linears": len(self.converted)}
