"""Quantization-aware training through torchao, as a Lightning callback, and the conversion after it.

Lightning removed its QAT callback in 2.0; torchao's ``quantize_(model, QATConfig(base, step=...))``
is the maintained tool, for one model in one process. Here:

- :class:`QuantizationAwareTraining` prepares the unchanged module in the callback's ``setup``
  hook, which Lightning runs before the strategy's setup: every ``nn.Linear`` selected becomes
  torchao's ``FakeQuantizedLinear`` (int8 per-token dynamic activations, int4 per-group or int8
  per-channel symmetric weights), and the strategy then cuts, replicates or shards that module as
  any other. The parameters keep their names and float values, so checkpoints, resharding and
  ``export`` are the float model's.
- :func:`convert_qat` turns the trained float weights (``export``'s file, loaded into the plain
  module in one process) into the real quantised model (torchao's int8/int4 tensors), which runs
  on the CPU and is saved with ``torch.save``. :func:`post_training_quantize` applies the same
  scheme to a model trained without QAT, for comparison.

Tensor parallelism is refused at setup for now: the plan must learn to shard a fake-quantised
projection and agree the per-token activation scales of a row-parallel input across the ranks (the
setup verification refuses the block otherwise).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_parallel.compression.selection import body_linears

__all__ = ["SCHEMES", "QuantizationAwareTraining", "convert_qat", "post_training_quantize"]

SCHEMES = ("8da4w", "8da8w")  # int8 dynamic activations with int4 (per group) or int8 (per channel) weights


def _torchao() -> Any:
    try:
        import torchao  # noqa: F401
    except ImportError as error:  # pragma: no cover - torchao is a test dependency
        raise ImportError("Quantization needs torchao: `pip install torchao`.") from error
    import torchao.quantization as quantization

    return quantization


def base_config(scheme: str, group_size: int) -> Any:
    """torchao's post-training config of ``scheme``: what QAT imitates and what conversion applies."""
    quantization = _torchao()
    from torchao.quantization.granularity import PerAxis, PerGroup

    # torchao's QAT prepares only the Intx configs: int8 weights per output channel (axis 0) for 8da8w.
    int4 = scheme == "8da4w"
    return quantization.Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4 if int4 else torch.int8,
        weight_granularity=PerGroup(group_size) if int4 else PerAxis(0),
    )


def selection(module: nn.Module, patterns: Sequence[str] | None) -> Callable[[nn.Module, str], bool]:
    """The ``filter_fn`` of ``quantize_``: the ``nn.Linear`` modules named by ``patterns``, by default all but
    the output head (``compression/selection.py``: the logits' precision matters most, and a head tied to
    the embedding would quantise the embedding)."""
    if patterns is None:
        chosen = set(body_linears(module))
    else:
        chosen = {
            n
            for n, m in module.named_modules()
            if isinstance(m, nn.Linear) and any(fnmatch.fnmatch(n, p) for p in patterns)
        }
    return lambda m, fqn: fqn in chosen


def check_groups(
    module: nn.Module, keep: Callable[[nn.Module, str], bool], scheme: str, group_size: int
) -> int:
    """The number of layers selected; a layer whose inputs are not whole groups is refused by name."""
    selected = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear) and keep(m, n)]
    if not selected:
        raise ValueError(
            "QuantizationAwareTraining selects no nn.Linear; name them with `modules=` (fnmatch patterns)."
        )
    if scheme == "8da4w":
        bad = [f"{n} ({m.in_features} inputs)" for n, m in selected if m.in_features % group_size]
        if bad:
            raise ValueError(
                f"`group_size={group_size}` does not divide the inputs of {bad}: each int4 weight group must lie in"
                " one row. Choose a group size that divides them, or leave those layers out with `modules=`."
            )
    return len(selected)


class QuantizationAwareTraining(Callback):
    """Fake-quantise the selected linear layers while training (torchao's QAT ``prepare`` step).

    Args:
        scheme: ``"8da4w"`` (int8 dynamic activations, int4 weights per group) or ``"8da8w"``.
        group_size: inputs per int4 weight group (``"8da4w"``).
        modules: ``fnmatch`` patterns of ``nn.Linear`` names (default: all but the output head).
    """

    def __init__(
        self, scheme: str = "8da4w", group_size: int = 32, modules: Sequence[str] | None = None
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"`scheme={scheme!r}` is not one of {SCHEMES}.")
        if group_size < 1:
            raise ValueError(f"`group_size={group_size}` must be a positive number of inputs.")
        self.scheme, self.group_size = scheme, group_size
        self.modules = list(modules) if modules is not None else None
        self.prepared = 0  # layers fake-quantised

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if any(type(m).__name__ == "FakeQuantizedLinear" for m in pl_module.modules()):
            return  # a second fit/validate on the same module: already prepared
        dims = getattr(trainer.strategy, "dims", None)
        if dims is not None and dims.tensor_parallel > 1:
            raise ValueError(
                f"QuantizationAwareTraining does not run under `tensor_parallel={dims.tensor_parallel}` yet: the plan"
                " does not shard fake-quantised projections. Use data, pipeline or ZeRO parallelism for QAT."
            )
        keep = selection(pl_module, self.modules)
        count = check_groups(pl_module, keep, self.scheme, self.group_size)
        quantization = _torchao()  # a clear message if torchao is missing
        from torchao.quantization.qat import QATConfig

        quantization.quantize_(
            pl_module, QATConfig(base_config(self.scheme, self.group_size), step="prepare"), keep
        )
        self.prepared = count


def convert_qat(
    module: nn.Module, scheme: str = "8da4w", group_size: int = 32, modules: Sequence[str] | None = None
) -> nn.Module:
    """The QAT-trained float ``module`` (weights loaded, one process) as torchao's quantised model, in place."""
    _torchao()
    from torchao.quantization.qat import QATConfig

    keep = selection(module, modules)
    check_groups(module, keep, scheme, group_size)
    base = base_config(scheme, group_size)
    _torchao().quantize_(module, QATConfig(base, step="prepare"), keep)
    _torchao().quantize_(module, QATConfig(base, step="convert"), keep)
    return module


def post_training_quantize(
    module: nn.Module, scheme: str = "8da4w", group_size: int = 32, modules: Sequence[str] | None = None
) -> nn.Module:
    """``module`` quantised with the same scheme without QAT (the comparison QAT must beat), in place."""
    keep = selection(module, modules)
    check_groups(module, keep, scheme, group_size)
    _torchao().quantize_(module, base_config(scheme, group_size), keep)
    return module
