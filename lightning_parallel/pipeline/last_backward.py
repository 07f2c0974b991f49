"""What each pipeline stage's last backward of a batch reduces: the data-parallel reduction, overlapped.

torch's schedules tell a stage which of its backward calls is the batch's last (``last_backward``:
the full backward, or under the zero-bubble schedules the weight pass). :class:`ReducingStage`
announces that call to :class:`LastBackward`, which

- opens it to the explicit reductions' gradient hooks on the batch that ends an optimizer step
  (``data_parallel/gradient_sync.py``): each bucket is all-reduced as soon as the call has made
  its gradients final, while the call goes on through the blocks below;
- under ZeRO on FSDP2, turns on the reduce-scatter of the units whose last stage this is, so FSDP2's
  own post-backward hooks reduce each unit as the call leaves it; what those hooks cannot see (the
  zero-bubble weight pass assigns gradients outside autograd's accumulation) is reduced right
  after the call.

A weight that two stages of this rank use (a tied embedding and head under the V schedules) is
final after the later of their last backwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_parallel.compat import without_sends_to_self
from lightning_parallel.data_parallel.gradient_sync import GradientSync
from lightning_parallel.pipeline.receive_buffers import ReceiveBuffers
from lightning_parallel.pipeline.split_backward import check_split_backward
from lightning_parallel.zero import fsdp_schedule
from lightning_parallel.zero.tensor_parallel import user_name


class ReducingStage(PipelineStage):
    """torch's stage, with its last backward of each batch (as the schedule says) announced, and its receive
    buffers held only while a micro-batch needs them (``pipeline/receive_buffers.py``)."""

    def __init__(self, *args: Any, last_backward: Callable[[int], Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_backward = last_backward
        self.receive_buffers = ReceiveBuffers()
        self._losses: dict[int, torch.Tensor] = {}  # the last stage's loss per micro-batch, until it is done
        # torch 2.11's split weight pass and the stages it gets wrong (split_backward.py): checked once
        self._split_checked = False

    # ---- receive buffers: placeholders from setup on, a buffer per receive posted ----

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self.receive_buffers.placeholders():
            prepared = super()._prepare_forward_infra(*args, **kwargs)
        self.receive_buffers.adopt(_infos(self.args_recv_info))
        return prepared

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with self.receive_buffers.placeholders():
            prepared = super()._prepare_backward_infra(*args, **kwargs)
        self.receive_buffers.adopt(_infos(self.grad_recv_info))
        return prepared

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        self.receive_buffers.take(self.args_recv_info.get(fwd_chunk_id, ()))
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        self.receive_buffers.take(self.grad_recv_info.get(bwd_chunk_id, ()))
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        # torch 2.13 zeroes the buffer of a gradient the next stage did not produce: it must be a real one
        infos = self.grad_recv_info.get(mb_index, ())
        self.receive_buffers.take(i for i, g in zip(infos, next_stage_bwd_outputs, strict=False) if g is None)
        return super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def _done_with(self, chunk: int) -> None:
        self.receive_buffers.give_back(
            [*self.args_recv_info.get(chunk, ()), *self.grad_recv_info.get(chunk, ())]
        )
        # The schedule keeps every micro-batch's loss until the step ends; its graph would keep the stage's
        # received input alive with it (the input's AccumulateGrad holds it). The value is all it needs now.
        loss = self._losses.pop(chunk, None)
        if loss is not None and not loss._is_view():
            loss.detach_()

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        # torch 2.11 opens a pair to each neighbour stage, also to one on this rank (the V schedules: stages 1
        # and 2 of two ranks), which gloo cannot connect; 2.13 warms up its pairs otherwise and never calls it.
        return without_sends_to_self(super()._get_init_p2p_neighbors_ops())

    def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
        # torch 2.11 infers the shapes a stage sends by running it once more (zero inputs, no_grad) before a
        # schedule's first step; its random draws (dropout) must not move the step's own: a resumed run would
        # draw differently from the uninterrupted one (measured: the data order after resuming). 2.13 has no
        # such method.
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return super()._shape_inference(*args, **kwargs)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        if isinstance(loss, torch.Tensor):
            self._losses[bwd_chunk_id] = loss
        if not full_backward and not self._split_checked:  # before torch's split passes read this graph
            outputs, inputs = self.fwd_cache[bwd_chunk_id]
            check_split_backward([loss] if isinstance(loss, torch.Tensor) else outputs, inputs, self.submod,
                                 self.stage_index)  # fmt: skip
            self._split_checked = True
        if not (last_backward and full_backward):
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        else:
            with self._last_backward(self.stage_index):
                super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward:  # a split backward's weight pass still reads the stage's input
            self._done_with(bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        if not last_backward:
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        else:
            with self._last_backward(self.stage_index):
                super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self._done_with(bwd_chunk_id)


def _infos(recv_info: dict[int, Any]) -> Iterator[Any]:
    for infos in recv_info.values():
        yield from infos


class LastBackward:
    """The reductions each of this rank's stages runs during its last backward of a batch."""

    def __init__(
        self, module: nn.Module, stage_parameters: dict[int, list[nn.Parameter]], fsdp_units: list[nn.Module]
    ) -> None:
        self.stage_parameters = stage_parameters
        self.fsdp_units = fsdp_units
        self.sync: GradientSync | None = None  # the explicit reductions, once attached (attach_sync)
        self.unit_stages = self._stages_of_units(module)
        self._ends_step = False
        self._units_left: dict[int, int] = {}  # per unit, this batch's last stage backwards still to come

    def _stages_of_units(self, module: nn.Module) -> list[set[int]]:
        """Per FSDP unit, this rank's stages whose parameters it holds."""
        fqns = {id(m): n for n, m in module.named_modules()}
        names_of = {id(p): user_name(n) for n, p in module.named_parameters()}
        stage_names = {s: {names_of[id(p)] for p in params} for s, params in self.stage_parameters.items()}
        out = []
        for unit in self.fsdp_units:
            prefix = fqns[id(unit)] + "." if fqns.get(id(unit)) else ""
            held = {user_name(prefix + n) for n, _ in unit.named_parameters()}
            out.append({s for s, names in stage_names.items() if held & names})
        return out

    def attach_sync(self, sync: GradientSync) -> None:
        """Open each stage's last backward of a batch to the explicit reductions (``parallelize/gradients.py``
        builds them from :meth:`final_calls` and hands them back here, once, at setup)."""
        if self.sync is not None:
            raise RuntimeError("LastBackward: the explicit reductions were attached already.")
        self.sync = sync

    def final_calls(self) -> dict[int, int]:
        """Per parameter (by id): how many of this rank's stages use it, each ending with one last backward."""
        counts: dict[int, int] = {}
        for params in self.stage_parameters.values():
            for param in params:
                counts[id(param)] = counts.get(id(param), 0) + 1
        return counts

    def start_batch(self, *, ends_step: bool) -> None:
        """A schedule starts; ``ends_step``: its batch is the last of an optimizer step."""
        self._ends_step = ends_step
        self._units_left = {i: len(stages) for i, stages in enumerate(self.unit_stages)}

    def end_batch(self) -> None:
        """The schedule is over: units no stage of this rank holds parameters of reduce now (none in practice)."""
        fsdp_schedule.reduce_accumulated(
            [u for u, s in zip(self.fsdp_units, self.unit_stages, strict=True) if not s]
        )
        self._ends_step = False

    @contextmanager
    def __call__(self, stage: int) -> Iterator[None]:
        """``stage``'s last backward of the batch: its gradients become final during it."""
        units = []
        for index, stages in enumerate(self.unit_stages):
            if stage in stages:
                self._units_left[index] -= 1
                if self._units_left[index] == 0:
                    units.append(self.fsdp_units[index])
        sync = self.sync if self._ends_step else None
        if units:  # every batch: ZeRO-2/3 keep gradients sharded between accumulation batches
            fsdp_schedule.reduce_in_backward(units)
        if sync is not None:
            sync.begin_final(self.stage_parameters[stage])
        yield
        if sync is not None:
            sync.end_final()
        if units:
            # what the hooks did not see (weight passes outside autograd's accumulation)
            fsdp_schedule.reduce_accumulated(units)
