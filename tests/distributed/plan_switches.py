"""Test-only negative controls of the automatic plan (``Case.switch_off``): one way of sharding a family's
attention taken away before setup, so that a family it serves is refused by the block verification.

- ``grouped_qkv``: no ``G groups of q|k|v`` layout of a fused projection (CodeGen's);
- ``paired_heads``: no heads paired across halves (differential attention);
- ``heads_first_bias``: model-level ``(heads, ...)`` tensors never cut to the rank's heads (MPT's ALiBi);
- ``returned_parameters``: a whole parameter the module returns keeps the summed gradient of the ones it uses;
- ``whole_sequence``: under sequence parallelism, a module left whole runs on the rank's slice of the sequence;
- ``block_entry_gathers``: under sequence parallelism, a container that is the block itself (OPT's MLP) gathers
  the block's input, as an attention or MLP module does;
- ``flattened_norm``: under sequence parallelism, a residual norm given ``(tokens, width)`` is cut along its
  features, as torch's ``SequenceParallel`` does;
- ``repeated_hidden``: a container given the hidden state more than once has only the first replaced;
- ``block_shares``: under sequence parallelism, the blocks' parameters no style covers keep each rank's share;
- ``stored_heads``: the verification checks a layer that reuses an earlier layer's keys and values on every
  head's, as captured from the unsharded model;
- ``gathered_hidden_units``: no mode gathers an MLP's hidden units for code that reduces over them;
- ``block_argument_slices``: under sequence parallelism, a block's per-token arguments stay whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

SWITCHES = (
    "grouped_qkv",
    "paired_heads",
    "heads_first_bias",
    "returned_parameters",
    "whole_sequence",
    "block_entry_gathers",
    "flattened_norm",
    "repeated_hidden",
    "block_shares",
    "stored_heads",
    "gathered_hidden_units",
    "block_argument_slices",
)


def _without_grouped(original: Any) -> Any:
    def fused_layouts(*args: Any, **kwargs: Any) -> list:
        return [(label, style) for label, style in original(*args, **kwargs) if "groups of" not in label]

    return fused_layouts


@contextmanager
def plan_feature_switched_off(switch_off: str | None, reference: bool) -> Iterator[None]:
    if reference or switch_off not in SWITCHES:
        yield
        return
    from lightning_parallel.plans import attention, auto
    from lightning_parallel.tensor_parallel import apply, param_styles, regions, verify

    with ExitStack() as stack:
        if switch_off == "grouped_qkv":
            stack.enter_context(
                mock.patch.object(attention, "fused_layouts", _without_grouped(attention.fused_layouts))
            )
        elif switch_off == "paired_heads":
            stack.enter_context(mock.patch.object(auto, "paired_heads_styles", lambda *a, **k: None))
        elif switch_off == "heads_first_bias":
            stack.enter_context(mock.patch.object(regions, "is_heads_first", lambda *a, **k: False))
        elif switch_off == "block_entry_gathers":
            hooks = apply.install_container_hooks
            stack.enter_context(
                mock.patch.object(
                    apply, "install_container_hooks", lambda *a, is_block=False, **k: hooks(*a, **k)
                )
            )
        elif switch_off == "flattened_norm":
            from torch.distributed.tensor.parallel import SequenceParallel

            from lightning_parallel.tensor_parallel import norm_styles

            plain = staticmethod(SequenceParallel._prepare_input_fn)
            stack.enter_context(mock.patch.object(norm_styles.ResidualNorm, "_prepare_input_fn", plain))
        elif switch_off == "repeated_hidden":
            stack.enter_context(
                mock.patch.object(regions, "replace_repeated_hidden", lambda args, kwargs, *_: (args, kwargs))
            )
        elif switch_off == "block_shares":
            stack.enter_context(mock.patch.object(auto, "sum_shares_over_tp", lambda *a, **k: None))
        elif switch_off == "stored_heads":
            stack.enter_context(
                mock.patch.object(verify, "stored_by_sharded_blocks", lambda inputs, mesh: inputs)
            )
        elif switch_off == "gathered_hidden_units":
            from lightning_parallel.tensor_parallel import verify_modes

            every = verify_modes.modes_to_try
            stack.enter_context(
                mock.patch.object(
                    verify, "modes_to_try", lambda c: [m for m in every(c) if not m.inner_gathered]
                )
            )
        elif switch_off == "block_argument_slices":  # apply.py: the model's sharding and the verification's
            stack.enter_context(mock.patch.object(apply, "install_block_argument_slices", lambda *a, **k: []))
        elif switch_off == "whole_sequence":
            stack.enter_context(mock.patch.object(apply, "install_whole_sequence", lambda *a, **k: []))
        else:
            stack.enter_context(
                mock.patch.object(param_styles, "_restore_handing_back_whole", param_styles._restore)
            )
        yield
