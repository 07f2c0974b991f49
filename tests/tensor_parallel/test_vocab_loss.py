"""The vocabulary-parallel cross-entropy and the mode that follows a sharded head's logits (two gloo ranks).

Against ``F.cross_entropy`` on the whole logits: the loss and the logits' gradient for every reduction, an
ignored index and label smoothing, in fp32 (1e-6) and from bf16 logits (as autocast computes it: fp32 inside).
The mode keeps reshapes, ``float()`` and slices outside the vocabulary sharded and computes the loss on
the shards; whatever else the step does with the logits (``argmax`` for an accuracy, a slice of the
vocabulary, class weights) gets them gathered, with the same numbers as without the mode: the negative
controls of "ran on the shards" are those fallbacks, recorded in ``gathered``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_parallel.tensor_parallel.vocab_loss import ShardedLogitsMode, vocab_parallel_cross_entropy
from tests.precision import spawn_gloo

N, V = 12, 10  # V not a multiple of the ranks: the last shard is short, as torch.chunk cuts


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    assert torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol), (what, got, want)


def _loss_against_torch(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full = torch.randn(N, V)
    target = torch.randint(0, V, (N,))
    target[3] = -100
    for dtype, rtol, atol in ((torch.float32, 1e-5, 1e-6), (torch.bfloat16, 1e-2, 1e-3)):
        for reduction in ("mean", "sum", "none"):
            for smoothing in (0.0, 0.1):
                what = (dtype, reduction, smoothing)
                want_in = full.to(dtype).clone().requires_grad_()
                want = F.cross_entropy(
                    want_in.float(), target, reduction=reduction, label_smoothing=smoothing
                )
                grad_out = torch.linspace(0.5, 1.5, N) if reduction == "none" else torch.tensor(1.0)
                want.backward(grad_out)
                got_in = distribute_tensor(full.to(dtype), mesh, [Shard(1)]).requires_grad_()
                got = vocab_parallel_cross_entropy(got_in, target, -100, reduction, smoothing)
                assert not isinstance(got, DTensor) and got.dtype == torch.float32
                got.backward(grad_out)
                _close(got, want, rtol, atol, what)
                assert got_in.grad.dtype == dtype
                _close(got_in.grad.full_tensor(), want_in.grad, rtol, atol, what)


def _mode_follows_the_logits(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full, y = torch.randn(2, 6, V), torch.randint(0, V, (2, 6))
    weights = torch.rand(V)
    mode = ShardedLogitsMode()
    with mode:
        logits = mode.track(distribute_tensor(full, mesh, [Shard(2)]).requires_grad_())
        flat = logits[:, :-1, :].reshape(-1, logits.size(-1)).float()  # kept sharded
        assert isinstance(flat, DTensor) and flat.placements == (Shard(1),)
        loss = F.cross_entropy(flat, y[:, 1:].reshape(-1))
        assert not isinstance(loss, DTensor) and mode.sharded_losses == 1 and not mode.gathered
        accuracy = (logits.argmax(-1) == y).float().mean()  # gathered, as without the mode
        weighted = F.cross_entropy(flat, y[:, 1:].reshape(-1), weight=weights)  # class weights: gathered
        first_five = logits[..., :5]  # a slice of the vocabulary: gathered
    assert mode.gathered == {"argmax", "cross_entropy", "__getitem__"}
    assert mode.sharded_losses == 1
    _close(loss, F.cross_entropy(full[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1)), 1e-5, 1e-6, "loss")
    _close(accuracy, (full.argmax(-1) == y).float().mean(), 0, 0, "accuracy")
    _close(weighted, F.cross_entropy(full[:, :-1].reshape(-1, V), y[:, 1:].reshape(-1), weight=weights), 1e-5,
           1e-6, "weighted")  # fmt: skip
    assert not isinstance(first_five, DTensor)
    _close(first_five, full[..., :5], 0, 0, "slice")
    mode.start_step()
    assert mode.sharded_losses == 0 and not mode.gathered


def _hooks_land_on_the_sharded_logits(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full, y = torch.randn(8, V), torch.randint(0, V, (8,))
    fired: list[str] = []
    mode = ShardedLogitsMode()
    with mode:
        logits = mode.track(distribute_tensor(full, mesh, [Shard(1)]).requires_grad_())
        # FSDP2 registers its pre-backward hook on a module's output tensors like this.
        logits.register_hook(lambda grad: fired.append("on the logits"))
        # The negative control: a hook on a gathered copy, which the loss on the shards never reaches.
        logits.full_tensor().register_hook(lambda grad: fired.append("on a gathered copy"))
        loss = F.cross_entropy(logits, y)
    assert mode.sharded_losses == 1 and not mode.gathered
    loss.backward()
    assert fired == ["on the logits"], fired


@pytest.mark.timeout(120)
def test_hooks_on_the_logits_run_in_the_backward_of_the_sharded_loss() -> None:
    """Found under ZeRO-3 x tp2: FSDP2's pre-backward hook went to a gathered copy, its weights stayed freed."""
    spawn_gloo(_hooks_land_on_the_sharded_logits, 2)


@pytest.mark.timeout(120)
def test_vocab_parallel_cross_entropy_equals_torch() -> None:
    spawn_gloo(_loss_against_torch, 2)


@pytest.mark.timeout(120)
def test_the_mode_computes_the_loss_on_the_shards_and_gathers_for_the_rest() -> None:
    spawn_gloo(_mode_follows_the_logits, 2)


def test_one_key_expansion_serves_both_followers() -> None:
    """``basic_index`` (tensor_parallel/regions.py) turns a key into one entry per dimension; the vocabulary follower
    keeps a slice that leaves the last dimension whole sharded, the context follower one that leaves the tokens whole.
    Negative controls: a tensor, ``None`` or a boolean in the key is not a basic index (both followers gather)."""
    import torch

    from lightning_parallel.tensor_parallel.regions import basic_index
    from lightning_parallel.tensor_parallel.vocab_loss import _cuts_vocabulary

    whole = slice(None)
    assert basic_index((slice(None, -1),), 3) == (slice(None, -1), whole, whole)
    assert basic_index((..., 0), 3) == (whole, whole, 0)
    assert basic_index((0, ..., slice(2)), 4) == (0, whole, whole, slice(2))
    for key in (torch.tensor([1]), (None, 0), (True,), (..., ...), (0, 0, 0, 0)):
        assert basic_index(key, 3) is None
    logits = torch.zeros(2, 3, 5)
    assert not _cuts_vocabulary("__getitem__", (logits, (slice(None), slice(None, -1))))
    assert _cuts_vocabulary("__getitem__", (logits, (..., slice(0, 4))))
    assert _cuts_vocabulary("__getitem__", (logits, torch.tensor([0])))
