"""Never silently wrong: check the plan on one block of each class before training.

Each distinct block class runs once unsharded and once sharded (on copies, in fp32, eval
mode) on the inputs it really receives in the user's first training step. Outputs, the
gradient of the block input and every parameter gradient must agree to 1e-5 (relative), or
setup fails naming the block and what differed. The same check chooses how attention code
is run: first on full-width inputs, and if that fails, on width-sliced inputs (for code that
reads the model width from its input, as nanoGPT does).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_parallel.comm.agreement import all_agree, communication_device
from lightning_parallel.tensor_parallel.apply import apply_tensor_parallel
from lightning_parallel.tensor_parallel.captured_inputs import (
    Captured,
    block_inputs,
    stored_by_sharded_blocks,
)
from lightning_parallel.tensor_parallel.plan import ParallelPlan
from lightning_parallel.tensor_parallel.regions import (
    find_hidden,
    sequence_length_problem,
)
from lightning_parallel.tensor_parallel.row_layout import row_layout
from lightning_parallel.tensor_parallel.verify_modes import keep_mode, modes_to_try, relative_plan

TOLERANCE = 1e-5


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """IEEE fp32 matmuls for a verification: with TF32 (on GPUs, where benchmarks turn it on) a right plan
    would differ from the unsharded block by more than the 1e-5 the check allows."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        torch.set_float32_matmul_precision(precision)


def first_tensor(output: Any) -> torch.Tensor:
    """A block's hidden-state output (the block may return a tuple)."""
    return output if isinstance(output, torch.Tensor) else output[0]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` in float64 (infinite for another shape); the verifications' measure."""
    return _difference_norm(actual, expected) / max(float(expected.double().norm()), 1e-12)


def cotangent_like(out: torch.Tensor) -> torch.Tensor:
    """The same seeded random output gradient for every run compared (the same on every rank)."""
    generator = torch.Generator(device="cpu").manual_seed(1234)
    return torch.randn(out.shape, generator=generator).to(out.device, out.dtype)


def _run(
    block: nn.Module, inputs: Captured, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    args, kwargs, hidden = block_inputs(inputs, dtype)
    out = first_tensor(block(*args, **kwargs))
    (out * cotangent_like(out)).sum().backward()
    return out.detach(), hidden.grad


def _compare_once(block: nn.Module, inputs: Captured, plan: ParallelPlan, mesh: DeviceMesh) -> str | None:
    reference = copy.deepcopy(block).float().eval()
    sharded = copy.deepcopy(block).float().eval()
    apply_tensor_parallel(sharded, plan, mesh)  # its relative plan names the block ""
    ref_out, ref_grad = _run(reference, inputs)
    out, grad = _run(sharded, stored_by_sharded_blocks(inputs, mesh))
    problems = []
    if (err := relative_error(out, ref_out)) > TOLERANCE:
        problems.append(
            f"output differs (relative error {err:.2e}, shapes {tuple(out.shape)} vs {tuple(ref_out.shape)})"
        )
    if (err := relative_error(grad, ref_grad)) > TOLERANCE:
        problems.append(f"input gradient differs (relative error {err:.2e})")
    exact: dict[str, torch.Tensor] | None = None  # computed only if a gradient differs
    fp32 = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    for name, ref_param in reference.named_parameters():
        grad = user_gradient(sharded.get_parameter(name))
        if ref_param.grad is None or grad is None or relative_error(grad, ref_param.grad) <= TOLERANCE:
            continue
        exact = exact if exact is not None else exact_gradients(block, inputs)
        problem = gradient_problem(name, grad, ref_param.grad, exact, fp32=fp32)
        if problem:
            problems.append(problem)
    return "; ".join(problems) or None


def user_gradient(param: torch.Tensor) -> torch.Tensor | None:
    """A sharded parameter's gradient in the user's layout: rows stored in another order put back, and a row
    stored on several ranks given the sum of its copies' shares (``tensor_parallel/row_layout.py``)."""
    grad, layout = param.grad, row_layout(param)
    if grad is None or layout is None:
        return grad
    return layout.summed(grad.full_tensor() if isinstance(grad, DTensor) else grad)


def ranks_with_other_inputs(captured: dict[str, Captured], mesh: DeviceMesh) -> list[int]:
    """The ranks of the tensor-parallel group whose first captured block input differs from the group's first rank's."""

    if not captured or mesh.size() == 1:
        return []
    hidden = find_hidden(*next(iter(captured.values())))[1].detach().double()
    group = mesh.get_group()
    device = communication_device(group)
    fingerprint = torch.stack([hidden.sum(), hidden.abs().sum(), (hidden * hidden).sum()]).to(device)
    gathered = [torch.empty_like(fingerprint) for _ in range(mesh.size())]
    dist.all_gather(gathered, fingerprint, group=group)
    ranks = dist.get_process_group_ranks(group)
    return [rank for rank, other in zip(ranks, gathered, strict=True) if not torch.equal(other, gathered[0])]


def gradient_problem(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    exact: dict[str, torch.Tensor],
    *,
    fp32: dict[str, torch.Tensor] | None = None,
) -> str | None:
    """Whether the sharded gradient of ``name`` is wrong (None: right), given the block's float64 gradients.

    Relative error at :data:`TOLERANCE`, plus twice the unsharded fp32 gradient's own distance from float64
    (rounding of the block's arithmetic, which the sharded gradient, summed in another order, may show as much
    of again: a long recurrence, Qwen 3.5's gated linear attention, loses 1e-5 in fp32). A gradient that is
    zero in exact arithmetic (a key-projection bias: softmax ignores a shift shared by all keys) holds only
    rounding noise in both runs, so its difference is judged against the block's largest gradient instead.
    Where the block has no float64 run (an op that overflows or lacks float64: XGLM's attention), the unsharded
    fp32 gradients (``fp32``) tell such a zero, at fp32's rounding (:data:`FP32_ZERO`).
    """
    zero = EXACT_ZERO
    if name not in exact and fp32:
        exact, zero = fp32, FP32_ZERO
    norms = {n: float(g.double().norm()) for n, g in exact.items()}
    largest = max(norms.values(), default=0.0)
    if norms.get(name, math.inf) <= zero * largest:
        absolute = _difference_norm(got, want) / max(largest, 1e-30)
        if absolute <= TOLERANCE:
            return None
        return f"gradient of `{name}` (zero in exact arithmetic) differs by {absolute:.2e} of the block's largest"
    own = relative_error(want, exact[name]) if name in exact else 0.0
    if (err := relative_error(got, want)) <= TOLERANCE + 2 * own:
        return None
    return f"gradient of `{name}` differs (relative error {err:.2e}; fp32's own {own:.1e})"


# A gradient this much smaller than the block's largest, in float64, is zero in exact arithmetic:
# float64 rounding is 1e-16, real gradients are not 1e9 times smaller than their block's largest.
EXACT_ZERO = 1e-9
# Without a float64 run: fp32 rounding leaves ~1e-7 of the block's scale on an exact zero; a real gradient
# 1e5 times smaller than its block's largest is judged, like a zero, on its distance in the block's scale.
FP32_ZERO = 1e-5


def exact_gradients(block: nn.Module, inputs: Captured) -> dict[str, torch.Tensor]:
    """The unsharded block's parameter gradients in float64 (on this rank, no communication)."""
    exact = copy.deepcopy(block).double().eval()
    try:
        _run(exact, inputs, torch.float64)
    except RuntimeError:  # a kernel without float64 (grouped_mm): the same sums by the experts' loop
        if not _eager_experts(exact):
            return {}
        exact.zero_grad(set_to_none=True)
        try:
            _run(exact, inputs, torch.float64)
        except RuntimeError:  # no float64 at all: every gradient keeps the relative rule
            return {}
    return {name: p.grad.detach() for name, p in exact.named_parameters() if p.grad is not None}


def _eager_experts(module: nn.Module) -> bool:
    """Switch Hugging Face experts that run a fused kernel (``grouped_mm``, without float64 on a CPU) to their
    per-expert loop, the same arithmetic in any dtype; whether any was switched."""
    switched = False
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "_experts_implementation", "eager") not in (None, "eager"):
            config._experts_implementation = "eager"  # type: ignore[union-attr]
            switched = True
    return switched


def _difference_norm(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected|`` in float64, a DTensor gathered first (infinite for another shape)."""
    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    if actual.shape != expected.shape:
        return float("inf")
    return float((actual.double() - expected.double()).norm())


def verify_and_choose_modes(
    model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, captured: dict[str, Captured]
) -> list[str]:
    """Verify each captured block; set ``narrow_input`` on attention containers that need it.

    Returns a line per verified block for the plan report. Raises ``ValueError`` when no mode
    reproduces the unsharded block.
    """
    if plan.sequence_parallel:  # before any collective (the tp ranks of a group share their batch)
        for block_name, inputs in captured.items():
            problem = sequence_length_problem(find_hidden(*inputs)[1], mesh.size(), f"block `{block_name}`")
            if problem:
                raise ValueError(problem)
    different = ranks_with_other_inputs(captured, mesh)
    if different:
        raise ValueError(
            f"The tensor-parallel ranks {different} received different batches at setup (the first block's"
            " input differs), but every rank of a tensor-parallel group must read the same batch: it computes"
            " a shard of the same tokens. Make the dataset identical on every rank (seed its generation, or read"
            " the same files) and let Lightning place the sampler (`use_distributed_sampler=True`), or give your"
            " own sampler `**trainer.strategy.distributed_sampler_kwargs` (replicas = data-parallel ranks)."
        )
    lines = []
    for block_name, inputs in captured.items():
        block = model.get_submodule(block_name)
        block_containers = [
            c for c in plan.containers if c.name == block_name or c.name.startswith(block_name + ".")
        ]
        failures = []
        for mode in modes_to_try(block_containers):
            try:
                with exact_fp32():
                    problem = _compare_once(block, inputs, relative_plan(plan, block_name, mode), mesh)
            except Exception as error:  # noqa: BLE001 - any failure of a mode means "try the next one"
                problem = f"{type(error).__name__}: {error}"
            if all_agree(problem is None):
                keep_mode(plan, model, block, mode)
                attention = "attention runs " if any(c.kind == "attention" for c in block_containers) else ""
                lines.append(
                    f"verified {type(block).__name__} ({block_name}): {attention}{mode.describe(block_containers)}"
                )
                break
            failures.append(f"{mode.describe(block_containers)}: {problem or 'failed on another rank'}")
        else:
            raise ValueError(
                f"The tensor-parallel plan for block `{block_name}` ({type(block).__name__}) does not reproduce the"
                f" unsharded block in any of the {len(failures)} ways tried: {_summary(failures)}. Pass `plan=` to"
                " shard it differently, or use tensor_parallel=1 for this model."
            )
    return lines


def _summary(failures: list[str], ways: int = 4, problems: int = 3) -> str:
    """The first ``ways`` failed ways with their first ``problems`` differences each: enough to see what breaks
    (a block can be tried 16 ways with 20 gradients each, too long for a message read in a log)."""
    shown = []
    for failure in failures[:ways]:
        found = failure.split("; ")
        more = f"; and {len(found) - problems} more" if len(found) > problems else ""
        shown.append("; ".join(found[:problems]) + more)
    rest = f" | and {len(failures) - ways} more ways" if len(failures) > ways else ""
    return " | ".join(shown) + rest
