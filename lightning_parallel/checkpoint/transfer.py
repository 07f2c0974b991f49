"""Weights in and out of the sharded world: one plain file in, one consolidated safetensors file out.

In: :func:`load_weights` puts a single-file state dict (``torch.save``'d ``.pt``/``.bin``, a
Lightning ``.ckpt`` or ``.safetensors``; e.g. the unparallelised module's ``state_dict()`` or a
pretrained model) into a module the strategy has already parallelized, any layout: each rank
reads the (memory-mapped) file and keeps its own part, a tensor-parallel shard
(``distribute_tensor(..., src_data_rank=None)``: no communication, right for fused q|k|v),
its experts' rows, its pipeline stage's parameters. The strategy calls it for
``HybridParallelStrategy(init_weights=path)``.

Out: :func:`export_checkpoint` reads a checkpoint of any layout (the sharded folder, or a
consolidated file) without processes and writes the model's weights as one safetensors file
whose names are the unparallelised module's: ``module.load_state_dict(load_file(out))``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_parallel.checkpoint.layouts import expert_layouts
from lightning_parallel.checkpoint.row_layouts import registry
from lightning_parallel.checkpoint.safe_load import load_trusted_or_weights
from lightning_parallel.compat import METADATA_FILENAME, read_checkpoint_entries

__all__ = ["consolidate_checkpoint", "export_checkpoint", "load_weights", "read_state_dict"]

PathLike = str | os.PathLike


def read_state_dict(path: PathLike) -> dict[str, torch.Tensor]:
    """The tensors of one file: safetensors, or ``torch.load`` (memory-mapped, ``weights_only``); from a
    Lightning checkpoint file its ``state_dict``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"`init_weights={str(path)!r}`: no such file. Give a single-file state dict (`.safetensors`, or a"
            " `torch.save`d `.pt`/`.bin`); a sharded checkpoint folder is resumed with `Trainer.fit(ckpt_path=...)`."
        )
    if path.suffix == ".safetensors":
        return load_file(path)
    state = load_trusted_or_weights(path, f"`init_weights={str(path)!r}`", map_location="cpu", mmap=True)
    if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"`init_weights={str(path)!r}` does not hold a state dict (a mapping of names to tensors). Save one"
            " with `torch.save(module.state_dict(), path)` or `safetensors.torch.save_file(...)`."
        )
    return dict(state)


def _prefix(module_keys: list[str], file_keys: list[str]) -> str:
    """The prefix that turns the file's names into the module's: ``""``, or e.g. ``"model."`` when the
    file holds the inner model of a LightningModule (a Hugging Face model saved on its own)."""
    known = set(module_keys)
    best, best_hits = "", sum(k in known for k in file_keys)
    candidates = {m[: -len(f)] for f in file_keys[:8] for m in module_keys if m.endswith("." + f)}
    for prefix in candidates:
        hits = sum(prefix + k in known for k in file_keys)
        if hits > best_hits:
            best, best_hits = prefix, hits
    return best


def _all_ranks(keys: set[str]) -> set[str]:

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return keys
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return set().union(*map(set, gathered))


def _fill_tied(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Tied weights saved once (``safetensors.torch.save_model`` drops the duplicates of shared tensors):
    a name missing from the file takes the tensor of a name it is tied to in this module."""
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    for names in names_by_param.values():
        present = [n for n in names if n in full]
        for name in names:
            if present and name not in full:
                full[name] = full[present[0]]


def load_weights(
    model: nn.Module, source: PathLike | Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load a full (unsharded) state dict into a parallelized ``model``, every rank its own part.

    Call it on every rank (the check of unexpected names is collective). ``strict``: every weight
    the module holds must be in the file, and every tensor of the file must land somewhere.
    """

    full = read_state_dict(source) if isinstance(source, (str, os.PathLike)) else dict(source)
    what = f"`init_weights={str(source)!r}`" if isinstance(source, (str, os.PathLike)) else "the state dict"
    target = {
        k: v for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor) and not v.is_meta
    }
    prefix = _prefix(list(target), list(full))
    full = {prefix + k: v for k, v in full.items()}
    _fill_tied(model, full)
    experts = expert_layouts(model)
    rows = registry(model)  # weights stored in a row layout: the user's rows, in the stored order
    loaded: dict[str, Any] = {}
    for name, current in target.items():
        if name not in full:
            continue
        value = full[name]
        shard = experts.get(name)
        if shard is not None:  # this rank's ep slice (under ZeRO on FSDP2, a DTensor over its replicas)
            expected = (shard.global_rows, *current.shape[1:])
        elif name in rows:
            expected = tuple(rows[name].user(torch.empty(current.shape, device="meta")).shape)
        else:
            expected = tuple(current.shape)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"{what}: {name!r} has shape {tuple(value.shape)} in the file but {expected} in the module. The file"
                " must hold the weights of this architecture (same sizes), as the unparallelised module's state_dict."
            )
        value = value.to(device=current.device, dtype=current.dtype)
        if shard is not None:
            value = value.narrow(0, shard.first_row, shard.local_rows).contiguous()
        if name in rows:
            value = rows[name].stored(value)
        if isinstance(current, DTensor):
            loaded[name] = distribute_tensor(
                value, current.device_mesh, current.placements, src_data_rank=None
            )
        else:
            loaded[name] = value
    missing = sorted(set(target) - set(loaded))
    unexpected = sorted(set(full) - _all_ranks(set(loaded)))
    if strict and (missing or unexpected):
        raise ValueError(
            f"{what} does not match the module{f' (names prefixed with {prefix!r})' if prefix else ''}:"
            f" missing {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)}),"
            f" unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)})."
            " Save the unparallelised module's `state_dict()` (or set the LightningModule's `strict_loading = False`"
            " to load what matches)."
        )
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))


def _read_checkpoint_weights(checkpoint: Path) -> dict[str, Any]:
    if checkpoint.is_file():
        return load_trusted_or_weights(checkpoint, "export", map_location="cpu")["state_dict"]
    if not (checkpoint / ".metadata").is_file() or not (checkpoint / METADATA_FILENAME).is_file():
        raise ValueError(
            f"`{checkpoint}` is not a checkpoint: expected a sharded checkpoint folder (with `.metadata` and"
            f" `{METADATA_FILENAME}`, as `Trainer.save_checkpoint` writes it) or a consolidated `.ckpt` file."
        )
    # Only the weights: the optimizer's states are never read.
    return read_checkpoint_entries(checkpoint, {"state_dict"})["state_dict"]


def _checkpoint_tensors(checkpoint: Path, prefix: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The weights of ``checkpoint`` under ``prefix`` (removed), floating point ones in ``dtype`` if given."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in _read_checkpoint_weights(checkpoint).items():
        if not name.startswith(prefix) or not isinstance(value, torch.Tensor):
            continue
        value = value.detach().cpu()
        tensors[name[len(prefix) :]] = (
            value.to(dtype) if dtype is not None and value.is_floating_point() else value
        )
    if not tensors:
        raise ValueError(f"`prefix={prefix!r}`: no weight of {checkpoint} starts with it.")
    return tensors


def consolidate_checkpoint(checkpoint: PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    """The weights of a checkpoint of any layout (ZeRO stage 1-3 or none; a sharded folder or a consolidated
    file) as one fp32 state dict of plain tensors: ``unparallelised_module.load_state_dict(result)``.

    No processes needed. Under ZeRO the values are the fp32 master weights; a checkpoint trained in half
    precision without ZeRO is converted to fp32. ``prefix``: keep only names under it, without it
    (``"model."``: the LightningModule's inner model). :func:`export_checkpoint` writes the same weights
    (in the dtype they were saved in, or one asked for) as a safetensors file.
    """
    return _checkpoint_tensors(Path(checkpoint), prefix, torch.float32)


def export_checkpoint(
    checkpoint: PathLike, output: PathLike, dtype: torch.dtype | None = None, prefix: str = ""
) -> Path:
    """Write the weights of ``checkpoint`` (any layout) as one safetensors file; return its path.

    Args:
        checkpoint: a sharded checkpoint folder or a consolidated ``.ckpt`` file.
        output: the ``.safetensors`` file to write.
        dtype: convert floating-point weights (e.g. ``torch.bfloat16`` for release); default as trained.
        prefix: keep only names under it, without it (``"model."``: the inner model of a
            LightningModule, e.g. for ``transformers``' ``from_pretrained``).
    """

    checkpoint, output = Path(checkpoint), Path(output)
    if output.suffix != ".safetensors":
        raise ValueError(f"`output={str(output)!r}` must end in `.safetensors` (the file format written).")
    tensors = {  # safetensors refuses shared storage (tied weights)
        name: value.contiguous().clone()
        for name, value in _checkpoint_tensors(checkpoint, prefix, dtype).items()
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, output, metadata={"format": "pt", "source": str(checkpoint)})
    return output


# ---- ``python -m lightning_parallel export CHECKPOINT OUTPUT`` -------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_export_command(commands: Any) -> None:
    """The ``export`` subcommand of ``python -m lightning_parallel`` (``cli.py``)."""
    export = commands.add_parser(
        "export", help="write a checkpoint (any layout, sharded folder or file) as one safetensors file"
    )
    export.add_argument(
        "checkpoint", help="sharded checkpoint folder (e.g. last.ckpt/) or consolidated .ckpt file"
    )
    export.add_argument("output", help="the .safetensors file to write")
    export.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="convert floating-point weights (default: as saved)"
    )
    export.add_argument(
        "--prefix",
        default="",
        help='keep names under this prefix, without it (e.g. "model.": the inner model)',
    )


def run_export(args: Any) -> str:
    out = export_checkpoint(
        args.checkpoint, args.output, _DTYPES.get(args.dtype) if args.dtype else None, args.prefix
    )
    return f"wrote {out} ({out.stat().st_size:,} bytes)"
