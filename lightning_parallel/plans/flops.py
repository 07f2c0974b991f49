"""Model FLOPs of an unchanged module, counted from its shapes (no processes, no forward pass).

The count MFU is quoted in (PaLM appendix B, Megatron, nanoGPT): 2 FLOPs per multiply-add of every
matmul weight a token meets (every ``nn.Linear`` / ``Conv1D``, the output head included; an
embedding lookup is free), plus attention's scores and weighted sum, ``4 x T x d_attn`` per
layer and token, causal attention counted in full; a training step is 3 times the forward
(backward: two matmuls per forward matmul). Mixture-of-Experts weights count ``top_k /
num_experts`` of theirs: a token meets ``top_k`` experts. For a GPT this is ``6 N + 12 L d T``
per token, ``N`` the parameters without embeddings.

Counted on the unparallelised module (a pipeline stage holds only part of it): the recipes count
once at construction and divide by the model-parallel ranks per device.
"""

from __future__ import annotations

import os

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch import nn

from lightning_parallel.experts import find_moe_blocks
from lightning_parallel.plans.detect import block_names, containers_in
from lightning_parallel.tensor_parallel.styles import is_projection, projection_dims

__all__ = ["PEAK_ENV", "forward_flops_per_token", "peak_flops", "training_flops_per_token"]


def _expert_fractions(model: nn.Module) -> dict[int, float]:
    """``id(parameter) -> top_k / num_experts`` for every routed expert weight (1 expert if top-k is unknown)."""
    out: dict[int, float] = {}
    for info in find_moe_blocks(model):
        fraction = (info.top_k or 1) / info.num_experts
        for name in info.expert_param_names:
            out[id(model.get_parameter(name))] = fraction
    return out


def _matmul_flops(model: nn.Module) -> float:
    """2 x the weight elements of every matmul a token meets, expert weights scaled by their fraction."""
    experts = _expert_fractions(model)
    counted: set[int] = set()
    total = 0.0
    for module in model.modules():
        if is_projection(module):
            inputs, outputs = projection_dims(module)
            weight = module.weight
            counted.add(id(weight))
            total += 2.0 * inputs * outputs * experts.get(id(weight), 1.0)
    for param in model.parameters():
        if id(param) in experts and id(param) not in counted and param.dim() == 3:  # stacked expert weights
            counted.add(id(param))
            total += 2.0 * param.numel() * experts[id(param)]
    return total


def _attention_widths(model: nn.Module) -> list[int]:
    """Per attention module of the block stack: the width attention computes in (its output projection's input)."""
    widths = []
    for name in block_names(model):
        for candidate in containers_in(model.get_submodule(name)):
            if candidate.looks_like_attention():
                widths.append(projection_dims(candidate.exit[1])[0])
    return widths


def forward_flops_per_token(model: nn.Module, sequence_length: int) -> float:
    """FLOPs of one token's forward pass through ``model`` for sequences of ``sequence_length`` tokens."""
    if sequence_length < 1:
        raise ValueError(f"`sequence_length={sequence_length}` must be a positive number of tokens.")
    attention = sum(4.0 * sequence_length * width for width in _attention_widths(model))
    return _matmul_flops(model) + attention


def training_flops_per_token(model: nn.Module, sequence_length: int) -> float:
    """FLOPs of one token of a training step: forward and backward (3 x the forward)."""
    return 3.0 * forward_flops_per_token(model, sequence_length)


# Dense peak FLOP/s of chips Lightning's table misses by name ("NVIDIA H200" reads as neither SXM
# nor NVL there); the rest come from Lightning's ``get_available_flops``.
_PEAKS = {"h200": {"bfloat16": 989.5e12, "float16": 989.5e12, "float32": 67e12, "tfloat32": 494.7e12}}
PEAK_ENV = "LP_PEAK_TFLOPS"
"""Environment variable: the device's peak in TFLOP/s, for a device neither table knows (or to override)."""


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak FLOP/s in ``dtype`` (None when unknown: a CPU, an unlisted GPU)."""
    if os.environ.get(PEAK_ENV):
        return float(os.environ[PEAK_ENV]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    key = (
        "tfloat32"
        if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
        else str(dtype).split(".")[-1]
    )
    for chip, peaks in _PEAKS.items():
        if chip in name and "sxm1" not in name and "nvl" not in name:
            return peaks.get(key)

    found = get_available_flops(device, dtype)
    return float(found) if found else None
