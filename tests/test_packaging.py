"""The library installs from its wheel beside a user's own torch and Lightning, and runs from there.

The wheel is built from this checkout and installed (``--no-deps``) into an empty virtual
environment whose only other packages are the test environment's (torch, Lightning, ...: a
``.pth`` path, so pip sees them as installed and ``pip check`` verifies the wheel's dependency
ranges against them). Then, from a folder outside the checkout: the package imports from the
new environment (not from this checkout), and ``python -m lightning_parallel plan`` runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = """
from torch import nn


class Attention(nn.Module):
    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))


class Block(nn.Module):
    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.attn = Attention(width, n_head)
        self.mlp = nn.Sequential()
        self.mlp.up, self.mlp.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)


class Tiny(nn.Module):
    def __init__(self, width: int = 32, n_head: int = 4, n_layer: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(Block(width, n_head) for _ in range(n_layer))
"""


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_the_wheel_installs_beside_torch_and_runs_the_plan_command(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
          str(ROOT)], tmp_path, env)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("lightning_parallel-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {n.split("/")[0] for n in names} == {
        "lightning_parallel",
        wheel.name.split("-py3")[0] + ".dist-info",
    }
    assert "lightning_parallel/strategy/hybrid.py" in names  # the library, and nothing named `recipes`
    requires = [
        line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert requires and not [line for line in requires if "==" in line]  # ranges, never exact pins
    assert "Requires-Dist: torch>=2.11" in requires and any(
        line.startswith("Requires-Dist: lightning<3,>=2.5") for line in requires
    )

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env
        ).strip()
    )
    _run(
        [str(python), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], tmp_path, env
    )  # the venv's own, older
    # torch, Lightning and the rest of the test environment, seen as installed by pip:
    (site / "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], tmp_path, env)
    _run(
        [str(python), "-m", "pip", "check"], tmp_path, env
    )  # the wheel's ranges hold for the user's versions

    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "tiny_model.py").write_text(MODEL)
    where = _run(
        [str(python), "-c", "import lightning_parallel; print(lightning_parallel.__file__)"], work, env
    )
    assert Path(where.strip()).is_relative_to(site)  # the installed copy, not this checkout
    out = _run([str(python), "-m", "lightning_parallel", "plan", "--model", "tiny_model.Tiny", "--tensor-parallel", "2"],
               work, env)  # fmt: skip
    assert "block stack: blocks (2 blocks)" in out and "blocks.0.attn.q" in out
