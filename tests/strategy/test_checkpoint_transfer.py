"""Weights in and out (``lightning_parallel/checkpoint/transfer.py``) without processes: file formats, the
name prefix of an inner model, and the errors for bad input. The layouts themselves (tp/pp/ep/dp) are
tested through the Trainer in ``test_checkpoint_layouts.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_parallel import export_checkpoint, load_weights
from lightning_parallel.cli import main as cli_main
from lightning_parallel.config.arguments import init_weights as check_init_weights


class Wrapper(nn.Module):
    """A LightningModule's shape: the model under ``model.``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in Wrapper().state_dict().items()}


@pytest.mark.parametrize("kind", ["safetensors", "pt", "inner_pt", "lightning_ckpt"])
def test_a_single_file_loads_whatever_its_format_and_prefix(kind: str, tmp_path: Path) -> None:
    weights = _weights(1)
    if kind == "safetensors":
        path = tmp_path / "w.safetensors"
        save_file(weights, path)
    elif kind == "pt":
        path = tmp_path / "w.pt"
        torch.save(weights, path)
    elif kind == "inner_pt":  # the inner model saved on its own, as a Hugging Face model is
        path = tmp_path / "w.bin"
        torch.save({k.removeprefix("model."): v for k, v in weights.items()}, path)
    else:
        path = tmp_path / "w.ckpt"
        torch.save({"state_dict": weights, "epoch": 3}, path)
    module = Wrapper()
    load_weights(module, check_init_weights(path))
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_a_file_that_does_not_match_the_module_is_refused(tmp_path: Path) -> None:
    weights = _weights(1)
    weights["model.0.weight"] = torch.zeros(5, 3)
    save_file(weights, tmp_path / "shape.safetensors")
    with pytest.raises(ValueError, match=r"'model.0.weight' has shape \(5, 3\) in the file but \(4, 3\)"):
        load_weights(Wrapper(), tmp_path / "shape.safetensors")
    partial = {k: v for k, v in _weights(1).items() if not k.startswith("model.1")}
    save_file(partial, tmp_path / "partial.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.1.bias', 'model.1.weight'\]"):
        load_weights(Wrapper(), tmp_path / "partial.safetensors")
    load_weights(Wrapper(), tmp_path / "partial.safetensors", strict=False)  # strict_loading = False


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("missing.safetensors", "must be an existing single-file state dict"),
        ("weights.txt", "must be an existing single-file state dict"),
        (3, "must be the path of a state-dict file"),
    ],
)
def test_init_weights_is_checked_when_the_strategy_is_built(
    value: object, message: str, tmp_path: Path
) -> None:
    if value == "weights.txt":
        (tmp_path / "weights.txt").write_text("x")
    argument = str(tmp_path / value) if isinstance(value, str) else value
    with pytest.raises(ValueError, match=message) as error:
        check_init_weights(argument)  # type: ignore[arg-type]
    assert "`init_weights=" in str(error.value)


def test_export_of_a_consolidated_file_and_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    weights = _weights(2)
    torch.save({"state_dict": weights, "optimizer_states": []}, tmp_path / "run.ckpt")
    out = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "model.safetensors")
    assert {k: v.tolist() for k, v in load_file(out).items()} == {k: v.tolist() for k, v in weights.items()}
    assert cli_main(["export", str(tmp_path / "run.ckpt"), str(tmp_path / "inner.safetensors"), "--prefix", "model.",
                     "--dtype", "bfloat16"]) == 0  # fmt: skip
    inner = load_file(tmp_path / "inner.safetensors")
    assert sorted(inner) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert inner["0.weight"].dtype == torch.bfloat16
    assert "wrote" in capsys.readouterr().out


def test_export_refuses_what_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="is not a checkpoint"):
        export_checkpoint(tmp_path / "folder", tmp_path / "out.safetensors")
    with pytest.raises(ValueError, match="must end in `.safetensors`"):
        export_checkpoint(tmp_path / "folder", tmp_path / "out.pt")
    assert cli_main(["export", str(tmp_path / "folder"), str(tmp_path / "out.safetensors")]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err


def test_tied_weights_saved_once_load_into_both_names(tmp_path: Path) -> None:
    """``safetensors.torch.save_model`` keeps one name of a shared tensor (embedding and head tied)."""
    from safetensors.torch import save_model

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
            self.head.weight = self.wte.weight

    torch.manual_seed(3)
    source = Tied()
    save_model(source, str(tmp_path / "tied.safetensors"))
    assert len(load_file(tmp_path / "tied.safetensors")) == 1
    target = Tied()
    load_weights(target, tmp_path / "tied.safetensors")
    assert torch.equal(target.head.weight, source.wte.weight) and target.head.weight is target.wte.weight


class _Payload:
    """What a hostile checkpoint carries: unpickling it calls ``os.mkdir(marker)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        import os

        return (os.mkdir, (str(self.marker),))


def _hostile(path: Path, marker: Path, lightning: bool) -> Path:
    weights = {**_weights(0), "model.extra": _Payload(marker)}
    torch.save({"state_dict": weights, "epoch": 0} if lightning else weights, path)
    return path


@pytest.mark.parametrize("route", ["init_weights", "export", "resume"])
def test_a_checkpoint_carrying_a_pickled_call_is_refused_not_run(route: str, tmp_path: Path) -> None:
    """Every load of ours unpickles with ``weights_only=True``: the file's code never runs."""
    from lightning_parallel.checkpoint.safe_load import UnsafeCheckpointError, load_trusted_or_weights
    from lightning_parallel.checkpoint.transfer import read_state_dict

    marker = tmp_path / "the_payload_ran"
    path = _hostile(tmp_path / "hostile.ckpt", marker, lightning=route != "init_weights")
    with pytest.raises(UnsafeCheckpointError, match="could run code from the file") as refusal:
        if route == "init_weights":
            read_state_dict(path)
        elif route == "export":
            export_checkpoint(path, tmp_path / "out.safetensors")
        else:  # what the strategy's load_checkpoint calls with Lightning's weights_only=None
            load_trusted_or_weights(path, "`Trainer.fit(ckpt_path=...)`", None, map_location="cpu")
    assert "GLOBAL posix.mkdir" in str(refusal.value)  # names what it refused
    assert not marker.exists()
    # Negative control: the user's explicit weights_only=False is the one way to run it.
    load_trusted_or_weights(path, "test", False, map_location="cpu")
    assert marker.exists()
