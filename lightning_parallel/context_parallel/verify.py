"""Never silently wrong: each distinct block class run split and whole at setup, before training.

The split is only right if every op of a block that mixes tokens is an attention call the
routing catches. A block whose attention is written out (``softmax(q @ k.T)``, Hugging Face's
"eager" implementation), or that mixes tokens some other way, would attend to this rank's tokens
only and train, silently, a different model. So on the inputs the user's first step really gave
it, each block class runs once whole and once split over the context ranks (fp32, eval mode, on
copies): the gathered output, the input gradient and every parameter gradient (averaged over the
context ranks, as training does) must agree to 1e-5, or setup fails naming the block.
"""

from __future__ import annotations

import copy

import torch.distributed as dist
from torch import nn

from lightning_parallel.comm.agreement import all_agree
from lightning_parallel.context_parallel.attention import ContextState, route_attention
from lightning_parallel.context_parallel.hooks import split_block_inputs
from lightning_parallel.context_parallel.split import gather
from lightning_parallel.context_parallel.ulysses import heads_check
from lightning_parallel.tensor_parallel.captured_inputs import Captured, block_inputs
from lightning_parallel.tensor_parallel.regions import find_hidden
from lightning_parallel.tensor_parallel.verify import (
    TOLERANCE,
    cotangent_like,
    exact_fp32,
    first_tensor,
    relative_error,
)


def _compare(block: nn.Module, captured: Captured, state: ContextState, seen: ContextState) -> str | None:
    group, degree = state.group, state.split.degree
    whole, split = copy.deepcopy(block).float().eval(), copy.deepcopy(block).float().eval()
    args, kwargs, hidden = block_inputs(captured)
    expected = first_tensor(whole(*args, **kwargs))
    cotangent = cotangent_like(expected)
    (expected * cotangent).sum().backward()

    route_attention(split, seen)
    args, kwargs, split_hidden = block_inputs(captured)
    args, kwargs = split_block_inputs(args, kwargs, seen, first=True)
    output = gather(first_tensor(split(*args, **kwargs)), state.split, group)
    (output * cotangent).sum().backward()
    problems = []
    if (err := relative_error(output.detach(), expected.detach())) > TOLERANCE:
        problems.append(f"output differs (relative error {err:.2e})")
    grads = [split_hidden.grad] + [p.grad for p in split.parameters() if p.grad is not None]
    for grad in grads:
        dist.all_reduce(grad, group=group)
        grad.div_(degree)
    if (err := relative_error(split_hidden.grad, hidden.grad)) > TOLERANCE:
        problems.append(f"input gradient differs (relative error {err:.2e})")
    for name, param in whole.named_parameters():
        mine = split.get_parameter(name).grad
        if (
            param.grad is not None
            and mine is not None
            and (err := relative_error(mine, param.grad)) > TOLERANCE
        ):
            problems.append(f"gradient of `{name}` differs (relative error {err:.2e})")
    return "; ".join(problems) or None


def verify_blocks(
    model: nn.Module, captured: dict[str, Captured], state: ContextState, tensor_parallel: int
) -> list[str]:
    """A line per verified block class for the setup log; ``ValueError`` when the split changes a block."""
    lines = []
    for name, inputs in captured.items():
        block = model.get_submodule(name)
        length = find_hidden(*inputs)[1].shape[1]
        state.split.check(length)  # the same batch on every rank: every rank raises alike
        seen = ContextState(state.split, state.group, state.mode)  # what the routed calls saw
        try:
            with exact_fp32():
                problem = _compare(block, inputs, state, seen)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure means the split cannot run this block
            problem = f"{type(error).__name__}: {error}"
        if not all_agree(problem is None):
            calls = (
                ""
                if seen.calls
                else (
                    " No `F.scaled_dot_product_attention` call was seen in it: its attention is computed by other ops"
                    ' (for a Hugging Face model, pass `attn_implementation="sdpa"`), which the split cannot route.'
                )
            )
            raise ValueError(
                f"Context parallelism does not reproduce block `{name}` ({type(block).__name__}):"
                f" {problem or 'it failed on another rank'}.{calls} Use `context_parallel=1` for this model."
            )
        if state.mode == "ulysses":
            for heads in sorted(seen.heads):
                if heads % tensor_parallel:
                    continue  # tensor parallelism refuses it itself
                heads_check(heads // tensor_parallel, state.split.degree)
        how = f"{seen.calls} attention call(s) routed" if seen is not None else ""
        lines.append(
            f"verified {type(block).__name__} ({name}) split over {state.split.degree} context ranks: {how}"
        )
    return lines
