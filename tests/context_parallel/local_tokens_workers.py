"""Rank functions of the tests of the head and loss on each rank's tokens (run by ``tests.experts.spawn.run_ranks``).

Every rank builds the same whole hidden state (what the last block would return in one process), the
same final norm, head and targets, and runs a training step's code after the stack twice: on the whole
sequence without the follower (the one-process reference), and on this rank's tokens with
:class:`~lightning_parallel.context_parallel.local_tokens.LocalTokensMode` following them. Gradients of the
split run are averaged over the ranks, as the data-parallel reduction averages them in training
(``context_parallel/split.py``), and compared with the reference's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_parallel.context_parallel.local_tokens import LocalTokensMode
from lightning_parallel.context_parallel.split import SequenceSplit, scatter

B, T, D, V = 2, 16, 8, 12
RTOL, ATOL = 1e-5, 1e-6
Params = dict[str, torch.Tensor]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, as its forward writes it."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + 1e-6)
    return weight * x.to(dtype)


def _logits(x: torch.Tensor, p: Params) -> torch.Tensor:
    return F.linear(F.layer_norm(x, (D,), p["norm"], p["bias"]), p["head"])


def nanogpt(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    logits = _logits(x, p)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100)


def hugging_face(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's tail: RMSNorm, ``hidden[:, slice(0, None), :]``, head, its ``ForCausalLMLoss``."""
    logits = F.linear(_rms_norm(x, p["norm"])[:, slice(0, None), :], p["head"]).float()
    labels = F.pad(y, (0, 1), value=-100)[..., 1:].contiguous()
    loss = F.cross_entropy(
        logits.view(-1, V), labels.view(-1).to(logits.device), ignore_index=-100, reduction="sum"
    )
    return loss / (labels != -100).sum()


def smoothed(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    logits = _logits(x, p)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=0.1)


def nll(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    log_probs = F.log_softmax(_logits(x, p), dim=-1)
    return F.nll_loss(log_probs.reshape(-1, V), y.reshape(-1), ignore_index=-100)


def per_token(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    logits = _logits(x, p)
    losses = F.cross_entropy(logits.view(-1, V), y.view(-1), reduction="none", ignore_index=-100)
    return (losses * torch.linspace(0.5, 1.5, losses.numel())).sum() / losses.numel()


def whole_shapes(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    """The step reads the logits' shape and reshapes by it, with a soft cap (Gemma 2) on the way."""
    logits = _logits(x, p)
    logits = 30.0 * torch.tanh(logits / 30.0)
    batch, length, vocab = logits.shape
    assert (batch, length, vocab) == (B, T, V) and len(logits) == B and logits.numel() == B * T * V
    return F.cross_entropy(
        logits.reshape(batch * length, vocab), y.reshape(batch * length), ignore_index=-100
    )


def shifted(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    """Slicing the sequence (a shift written on the logits): it needs the whole sequence."""
    logits = _logits(x, p)[:, :-1, :]
    return F.cross_entropy(logits.reshape(-1, V), y[:, 1:].reshape(-1), ignore_index=-100)


def z_loss_and_accuracy(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    """PaLM's z-loss (a mean over tokens of a per-token value) and an accuracy (logits against targets)."""
    logits = _logits(x, p)
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    accuracy = (logits.argmax(dim=-1) == y).float().mean().detach()
    return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100) + 1e-2 * z + 0.0 * accuracy


def masked_in_place(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    """An assignment into the logits that keeps each token to itself (a banned token), after a view was taken: it
    runs on this rank's tokens, and the view sees it."""
    logits = _logits(x, p)
    flat = logits.view(-1, V)
    logits[..., 0] = -5.0
    return F.cross_entropy(flat, y.view(-1), ignore_index=-100)


def logged_without_grad(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    """A metric under ``no_grad`` gathers the logits first; the loss after it still has its gradient."""
    logits = _logits(x, p)
    with torch.no_grad():
        peak = logits[:, :-1].max()
    return (
        F.cross_entropy(logits[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), ignore_index=-100) + 0.0 * peak
    )


class _Doubled(torch.autograd.Function):
    """A custom function (a fused kernel's stand-in): its forward reads the shape of the storage it is given."""

    seen: tuple[int, ...] = ()

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _Doubled.seen = tuple(x.shape)
        return x * 2.0

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 2.0


def custom_function(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    logits = _Doubled.apply(_logits(x, p))
    return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100)


def position_write(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    """A write at a sequence position (it mixes tokens across ranks): refused, not a drifting copy."""
    logits = _logits(x, p)
    logits[:, 0] = 0.0
    return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100)


def weighted(x: torch.Tensor, p: Params, y: torch.Tensor) -> torch.Tensor:
    """Class weights: the loss is not computed on the tokens (it gathers, the same loss)."""
    logits = _logits(x, p)
    return F.cross_entropy(
        logits.view(-1, V), y.view(-1), weight=torch.linspace(0.5, 2.0, V), ignore_index=-100
    )


STEPS: dict[str, Callable[[torch.Tensor, Params, torch.Tensor], torch.Tensor]] = {
    step.__name__: step
    for step in (nanogpt, hugging_face, smoothed, nll, per_token, whole_shapes, shifted, z_loss_and_accuracy,
                 masked_in_place, logged_without_grad, custom_function, position_write, weighted)
}  # fmt: skip


def _inputs() -> tuple[torch.Tensor, Params, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, D, generator=generator)
    params = {
        "norm": 1.0 + 0.1 * torch.randn(D, generator=generator),
        "bias": 0.1 * torch.randn(D, generator=generator),
        "head": torch.randn(V, D, generator=generator) / D**0.5,
    }
    targets = torch.randint(V, (B, T), generator=generator)
    targets[0, :3] = -100  # ignored positions (padding), on the first rank's chunk
    return hidden, params, targets


def _leaves(hidden: torch.Tensor, params: Params) -> tuple[torch.Tensor, Params]:
    return hidden.clone().requires_grad_(), {k: v.clone().requires_grad_() for k, v in params.items()}


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def compare(rank: int, world_size: int, name: str, followed: bool = True) -> dict[str, object]:
    """``followed=False`` (the negative control): each rank's loss of its own tokens, as a step written
    for one process computes it on a split hidden state with this rank's targets, without the follower."""
    step = STEPS[name]
    hidden, params, targets = _inputs()
    h, p = _leaves(hidden, params)
    reference = step(h, p, targets)
    reference.backward()
    expected = {"hidden": h.grad, **{k: _grad(v) for k, v in p.items()}}

    split = SequenceSplit(world_size, rank)
    mode = LocalTokensMode(split, dist.group.WORLD)
    h, p = _leaves(hidden, params)
    mine = scatter(h, split, dim=1)
    try:
        if followed:
            with mode:
                loss = step(mode.track_exit(mine), p, targets)
        else:
            loss = step(mine, p, scatter(targets, split, dim=1))
    except ValueError as error:
        return {"refused": str(error)}
    loss.backward()
    grads = {"hidden": h.grad, **{k: _grad(v) for k, v in p.items()}}
    for grad in grads.values():  # the data-parallel average over the context ranks
        dist.all_reduce(grad)
        grad /= world_size
    return {
        "loss": float(loss.detach()),
        "reference": float(reference.detach()),
        "loss_close": _close(loss.detach(), reference.detach()),
        "grads_close": all(_close(grads[k], expected[k]) for k in expected),
        "local_losses": mode.local_losses,
        "gathered": sorted(mode.gathered),
        "function_saw": _Doubled.seen,
    }


def compare_all(rank: int, world_size: int, settings: list[tuple[str, bool]]) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    return [compare(rank, world_size, name, followed) for name, followed in settings]
