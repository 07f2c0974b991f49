"""Forward hooks that let unchanged attention/MLP code run on local shards.

Two boundaries need care when the user's module code is left as it is:

1. The *container* boundary (an attention or MLP module). Its input, the hidden states, is
   turned into one replicated DTensor here, once, and handed to every entry projection
   (q, k, v or gate, up). Their input gradients then accumulate as one ``Partial`` DTensor
   and are reduced by a single all-reduce (or reduce-scatter under sequence parallelism):
   Megatron's "f" operator. Converting per projection would cost one collective each.
   The module body itself sees a plain local tensor. In *narrow* mode it sees only this
   rank's slice of the hidden dimension, for code that reads the model width from its input
   (nanoGPT's ``B, T, C = x.size()`` followed by ``view(B, T, C)``): with the head count and
   width attributes divided by the TP degree, that code then computes exactly its local heads.
2. The *sequence-parallel region*: the repeated block stack. Entering the first block the
   replicated residual stream is split along the sequence (a local slice; its backward is an
   all-gather); leaving the last block it is all-gathered back. Model-level code outside the
   stack (position ids, causal masks, the head) therefore still sees the full sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.hooks import RemovableHandle

from lightning_parallel.tensor_parallel.block_arguments import (
    forget_slices,
    map_items,
    remember_slice,
    whole_arguments,
)

HIDDEN_KWARGS = ("hidden_states", "x", "hidden", "inputs", "input", "h")
SEQUENCE_DIM = 1


def flat_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    """A call's arguments one level deep (the items of a list or tuple argument too): where a function-mode
    follower looks for the tensors it follows."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def basic_index(key: Any, ndim: int) -> tuple[int | slice, ...] | None:
    """An indexing key of integers, slices and at most one ``...`` as one integer or slice per dimension of an
    ``ndim``-dimensional tensor (``...`` and the missing trailing entries as whole slices); None for any other key
    (tensors, ``None``, booleans): where a function-mode follower asks which dimensions an indexing keeps whole."""
    key = key if isinstance(key, tuple) else (key,)
    basic = all((isinstance(k, (int, slice)) and not isinstance(k, bool)) or k is Ellipsis for k in key)
    if not basic or sum(k is Ellipsis for k in key) > 1:
        return None
    if Ellipsis in key:
        at = key.index(Ellipsis)
        key = (*key[:at], *[slice(None)] * (ndim - len(key) + 1), *key[at + 1 :])
    if len(key) > ndim:
        return None
    return (*key, *[slice(None)] * (ndim - len(key)))


def find_hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | int, torch.Tensor]:
    """``(position or keyword, tensor)`` of the hidden state among a block's (or container's) arguments.

    Shared by every hook that must change what a block receives: sequence-parallel regions
    here, the pipeline's stage boundaries and discovery (``pipeline/``).
    """
    if args and isinstance(args[0], torch.Tensor):
        return 0, args[0]
    for key in HIDDEN_KWARGS:
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor):
            return key, value
    raise ValueError(
        "lightning_parallel could not find the hidden-state tensor of a sharded module: it looks for the"
        f" first positional argument or one of the keyword arguments {HIDDEN_KWARGS}."
    )


def replace_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], where: str | int, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with the hidden state found by :func:`find_hidden` at ``where`` replaced by ``value``."""
    if isinstance(where, int):
        return (value, *args[1:]), kwargs
    return args, {**kwargs, where: value}


def replace_repeated_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with every one that *is* the hidden state replaced by ``value``: a module may take the
    hidden state more than once (CTRL's attention as its values, keys and queries)."""
    return tuple(value if a is hidden else a for a in args), {
        k: value if v is hidden else v for k, v in kwargs.items()
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    wait = getattr(local, "wait", None)  # AsyncCollectiveTensor: materialise before plain code uses it
    return wait() if callable(wait) else local


def local_heads(value: Any, batch: int, heads: int, mesh: DeviceMesh, *, heads_first: bool = False) -> Any:
    """``value`` cut to this rank's block of heads when it carries one entry per head, else as it is.

    Attention biases made once at model level and handed to every block (Bloom's, MPT's ALiBi, CPM-Ant's
    learned relative-position bias) come as ``(batch * heads, ...)``, ``(batch or 1, heads, ...)`` or
    ``(heads, ...)`` (MPT's ``(heads, 1, positions)``); under tensor parallelism the block holds
    ``heads / tensor_parallel`` of the heads, the rank's contiguous block of them. A learned bias gets from
    each rank the gradient of its heads only: the cut's backward gathers the ranks' pieces, so the
    model-level weights that made it get the whole gradient on every rank. ``heads_first``: the argument is
    a ``(heads, ...)`` tensor, as :func:`is_heads_first` saw it on a call where its size told.
    """
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() < 2:
        return value
    if heads > 1 and value.shape[0] == batch * heads:
        grouped = _heads_of(value.view(batch, heads, *value.shape[1:]), heads, mesh)
        return grouped.reshape(-1, *value.shape[1:])
    if value.dim() >= 3 and value.shape[1] == heads and value.shape[0] in (1, batch):
        return _heads_of(value, heads, mesh)
    if heads_first and value.shape[0] == heads:
        return _heads_of(value.unsqueeze(0), heads, mesh).squeeze(0)
    return value


def is_heads_first(value: Any, batch: int, heads: int) -> bool | None:
    """Whether ``value`` is a ``(heads, ...)`` tensor (None: cannot tell, ``heads`` equals ``batch``)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or heads <= 1 or value.shape[0] != heads:
        return False
    if value.dim() >= 3 and value.shape[1] == heads:
        return False
    return None if heads == batch else True


def _heads_of(value: torch.Tensor, heads: int, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's block of ``value``'s dimension 1; its backward all-gathers the blocks when ``value`` needs a
    gradient (a replicated tensor redistributed to a shard: torch's own backward of that is the gather)."""
    if not value.requires_grad:
        size = heads // mesh.size()
        return value.narrow(1, mesh.get_local_rank() * size, size)
    replicated = DTensor.from_local(value, mesh, [Replicate()], run_check=False)
    return replicated.redistribute(mesh, [Shard(1)]).to_local()


def install_container_hooks(
    container: nn.Module,
    entries: list[nn.Module],
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    narrow_width: int | None,
    slice_heads: int | None = None,
    is_block: bool = False,
) -> list[RemovableHandle]:
    """Share one DTensor input among ``entries``; optionally narrow what the body sees.

    ``slice_heads``: the model's attention heads, when the tensors besides the hidden state that carry
    one entry per head are to be cut to this rank's heads (:func:`local_heads`).
    ``is_block``: the container is a block itself (OPT's ``fc1`` and ``fc2`` are the layer's): under sequence
    parallelism the block's input is its slice of the sequence and stays so (the block's attention gathers its
    own); what its entries read is gathered as they receive it, once for entries reading the same tensor.
    """
    if is_block and sequence_parallel:
        return _install_entry_gathers(container, entries, mesh)
    input_placement = Shard(SEQUENCE_DIM) if sequence_parallel else Replicate()
    rank = mesh.get_local_rank()

    # per argument: whether it is a (heads, ...) tensor, decided on the first call where batch and heads
    # differ and kept, so that a later batch or sequence length cannot change how an argument is read
    heads_first: dict[str | int, bool] = {}

    def cut_heads(args: tuple[Any, ...], kwargs: dict[str, Any], where: str | int, batch: int) -> Any:
        def cut(key: str | int, value: Any) -> Any:
            assert slice_heads is not None
            if key not in heads_first and isinstance(value, torch.Tensor) and value.dim() >= 2:
                seen = is_heads_first(value, batch, slice_heads)
                if seen is not None:
                    heads_first[key] = seen
            first = heads_first.get(key, False)
            return local_heads(value, batch, slice_heads, mesh, heads_first=first)

        args = tuple(a if i == where else cut(i, a) for i, a in enumerate(args))
        return args, {k: v if k == where else cut(k, v) for k, v in kwargs.items()}

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = whole_arguments(args, kwargs)  # the block's per-token arguments, cut with it under sp
        where, hidden = find_hidden(args, kwargs)
        if slice_heads is not None:
            args, kwargs = cut_heads(args, kwargs, where, hidden.shape[0])
        if isinstance(hidden, DTensor):
            shared = hidden.redistribute(mesh, [Replicate()])
        else:
            # tokens flattened to (tokens, width) (an MoE's shared expert): the sequence shards are along dim 0
            placement = Shard(0) if sequence_parallel and hidden.dim() == 2 else input_placement
            shared = DTensor.from_local(hidden, mesh, [placement], run_check=False)
            if sequence_parallel:
                shared = shared.redistribute(mesh, [Replicate()])
        body_input = _local(shared)
        if narrow_width is not None:
            body_input = body_input.narrow(-1, rank * narrow_width, narrow_width)
        for entry in entries:
            entry._lp_shared_input = (body_input, shared)
        args, kwargs = replace_repeated_hidden(args, kwargs, hidden, body_input)
        return replace_hidden(args, kwargs, where, body_input)

    def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
        for entry in entries:
            entry._lp_shared_input = None
        return output

    def entry_pre_hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
        shared = getattr(module, "_lp_shared_input", None)
        if shared is not None and args and args[0] is shared[0]:
            return (shared[1], *args[1:])
        return None

    handles = [
        container.register_forward_pre_hook(pre_hook, with_kwargs=True),
        container.register_forward_hook(post_hook),
    ]
    for entry in entries:
        entry._lp_shared_input = None
        handles.append(entry.register_forward_pre_hook(entry_pre_hook, prepend=True))
    return handles


def _install_entry_gathers(
    container: nn.Module, entries: list[nn.Module], mesh: DeviceMesh
) -> list[RemovableHandle]:
    gathered: dict[
        int, tuple[torch.Tensor, DTensor]
    ] = {}  # id(slice) -> (the slice, gathered), one block call

    def entry_pre_hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
        if not args or not isinstance(args[0], torch.Tensor) or isinstance(args[0], DTensor):
            return None
        local = args[0]
        known = gathered.get(id(local))
        if known is None or known[0] is not local:
            placement = Shard(0) if local.dim() == 2 else Shard(SEQUENCE_DIM)  # tokens flattened: along dim 0
            shared = DTensor.from_local(local, mesh, [placement], run_check=False).redistribute(
                mesh, [Replicate()]
            )
            known = gathered[id(local)] = (local, shared)
        return (known[1], *args[1:])

    def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
        gathered.clear()
        return output

    handles = [container.register_forward_hook(post_hook)]
    handles += [entry.register_forward_pre_hook(entry_pre_hook, prepend=True) for entry in entries]
    return handles


def sequence_length_problem(hidden: torch.Tensor, tensor_parallel: int, where: str) -> str | None:
    """Why ``hidden`` cannot be split along the sequence over ``tensor_parallel`` ranks (None: it can).

    Checked before any collective: an uneven split gives the ranks differently sized shards, whose
    collectives then disagree and fail inside torch.distributed (gloo: "connection reset by peer").
    """
    if hidden.dim() <= SEQUENCE_DIM:
        return f"`sequence_parallel=True`: {where} receives a hidden state of shape {tuple(hidden.shape)}, with no sequence dimension {SEQUENCE_DIM}."
    length = hidden.shape[SEQUENCE_DIM]
    if length % tensor_parallel == 0:
        return None
    up = -(-length // tensor_parallel) * tensor_parallel
    return (
        f"`sequence_parallel=True` splits the sequence over the {tensor_parallel} tensor-parallel ranks, but"
        f" {where} receives sequences of {length} tokens (hidden state {tuple(hidden.shape)}), which"
        f" {tensor_parallel} does not divide. Pad or crop the sequences to a multiple of {tensor_parallel}"
        f" (e.g. {up} or {up - tensor_parallel}), or set `sequence_parallel=False`."
    )


def scatter_sequence(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Replicated -> this rank's sequence slice (no communication; backward all-gathers)."""
    problem = sequence_length_problem(tensor, mesh.size(), "the first block")
    if problem:
        raise ValueError(problem)
    dt = DTensor.from_local(tensor, mesh, [Replicate()], run_check=False)
    return _local(dt.redistribute(mesh, [Shard(SEQUENCE_DIM)]))


def gather_sequence(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sequence slice -> replicated (all-gather; backward takes the local slice)."""
    dt = DTensor.from_local(tensor, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
    return _local(dt.redistribute(mesh, [Replicate()]))


def map_first_tensor(output: Any, fn: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (fn(output[0]), *output[1:])
    if isinstance(output, list) and output and isinstance(output[0], torch.Tensor):
        return [fn(output[0]), *output[1:]]
    raise ValueError(
        f"lightning_parallel: a transformer block returned {type(output).__name__}; sequence parallelism"
        " expects a tensor or a tuple whose first element is the hidden states."
    )


def _install_region(
    first: nn.Module, last: nn.Module, entering: Any, leaving: Any, *, whole_arguments_in: bool = False
) -> list[RemovableHandle]:
    """``entering`` applied to the hidden state ``first`` receives, ``leaving`` to the one ``last`` returns;
    ``whole_arguments_in``: the block's per-token arguments given whole again too."""

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if whole_arguments_in:
            args, kwargs = whole_arguments(args, kwargs)
        where, hidden = find_hidden(args, kwargs)
        return replace_hidden(args, kwargs, where, entering(hidden))

    def leave(module: nn.Module, args: Any, output: Any) -> Any:
        return map_first_tensor(output, leaving)

    return [
        first.register_forward_pre_hook(enter, with_kwargs=True),
        last.register_forward_hook(leave),
    ]


def install_sequence_region(first: nn.Module, last: nn.Module, mesh: DeviceMesh) -> list[RemovableHandle]:
    """Split the residual stream along the sequence entering ``first``, gather it leaving ``last``."""
    return _install_region(
        first, last, lambda t: scatter_sequence(t, mesh), lambda t: gather_sequence(t, mesh)
    )


def install_whole_sequence(module: nn.Module, mesh: DeviceMesh) -> list[RemovableHandle]:
    """Run ``module`` (left whole) on the whole sequence inside the sequence-parallel region: its hidden-state
    argument gathered entering it, this rank's slice of its hidden output leaving it. Every rank computes the
    same whole output; the slice's backward all-gathers the output's gradient, so each rank computes the whole
    gradient of the module's weights (the same everywhere, as for a module replicated without sequence
    parallelism) and takes its slice of the input's gradient."""
    gather, scatter = (lambda t: gather_sequence(t, mesh)), (lambda t: scatter_sequence(t, mesh))
    return _install_region(module, module, gather, scatter, whole_arguments_in=True)


def install_block_argument_slices(block: nn.Module, mesh: DeviceMesh) -> list[RemovableHandle]:
    """Entering ``block`` (after the sequence-parallel region cut its hidden state), cut its other per-token
    arguments to this rank's slice; leaving it, forget them."""
    size = mesh.size()

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        where, hidden = find_hidden(args, kwargs)
        if hidden.dim() < 3:
            return None
        batch, whole_length = hidden.shape[0], hidden.shape[1] * size

        def cut(value: Any) -> Any:
            if (
                not isinstance(value, torch.Tensor)
                or value is hidden
                or value.dim() < 2
                or value.shape[0] != batch
                or value.shape[1] != whole_length
            ):
                return value
            piece = scatter_sequence(value, mesh)
            remember_slice(piece, value)
            return piece

        new_args = tuple(a if i == where else map_items(cut, a) for i, a in enumerate(args))
        return new_args, {k: v if k == where else map_items(cut, v) for k, v in kwargs.items()}

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        forget_slices()

    return [
        block.register_forward_pre_hook(enter, with_kwargs=True),
        block.register_forward_hook(leave, always_call=True),
    ]
