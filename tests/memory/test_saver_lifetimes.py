"""What the compressing and offloading saver keeps for a micro-batch goes with that micro-batch's backward.

Under pipeline stages the saver's context spans the whole schedule: every micro-batch's forward and backward
run inside it. The saver's own index of the storages it packed (to pack each storage once) had held each
stored copy until the context ended: the compressed copies on the device, the host copies and, once backward
had brought them back, their device copies, of every micro-batch of the step at once (GPipe's memory under
any schedule). The index now holds them weakly: the graph's saved views are what keeps a copy.

One process, the recipe GPT, micro-batches run one after another (forward, then backward) inside one context,
as 1F1B's steady state runs them. After each backward no stored copy of that micro-batch is alive. Negative
control: a saved view kept past its backward (as the graph of a micro-batch still in flight keeps it) keeps its
copy.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lightning_parallel.memory.saved_tensors import ActivationSaver
from lightning_parallel.memory.stored import _StoredStorage
from lightning_parallel.plans.detect import find_block_stack
from tests.memory.test_activation_memory import B, T, V, gpt

MICRO_BATCHES = 3


def _tracking(alive: list[weakref.ref]) -> None:
    """Record every stored copy the saver makes (weakly)."""
    original = _StoredStorage.__init__

    def init(self: _StoredStorage, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        if self.copies:
            alive.append(weakref.ref(self))

    _StoredStorage.__init__ = init  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "saver_kwargs", [{"compression": "bf16"}, {"offload": True}, {"compression": "fp8", "offload": True}]
)
def test_a_micro_batch_s_stored_copies_go_with_its_backward(
    monkeypatch: pytest.MonkeyPatch, saver_kwargs: dict
) -> None:
    monkeypatch.setattr(_StoredStorage, "__init__", _StoredStorage.__init__)  # restored after the test
    alive: list[weakref.ref] = []
    _tracking(alive)
    model = gpt(3)
    saver = ActivationSaver(parameters=list(model.parameters()), blocks=list(find_block_stack(model).blocks),
                            **saver_kwargs)  # fmt: skip
    x = torch.randint(V, (MICRO_BATCHES, B, T), generator=torch.Generator().manual_seed(1))
    kept_view = None
    with saver.context():
        for m in range(MICRO_BATCHES):
            before = len(alive)
            loss = model(x[m]).logsumexp(-1).mean()
            made = len(alive) - before
            assert made > 0  # the saver really stored copies of this micro-batch
            if m == 0:  # negative control: a graph still in flight keeps its copies
                kept_view = loss.grad_fn
                loss.backward(retain_graph=True)
                gc.collect()
                assert sum(ref() is not None for ref in alive[before:]) > 0
                kept_view = None
                del loss
            else:
                loss.backward()
                del loss
            gc.collect()
            assert all(ref() is None for ref in alive[before:]), (
                m,
                sum(ref() is not None for ref in alive[before:]),
                made,
            )
    assert kept_view is None
