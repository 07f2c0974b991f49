"""Build DeepSpeed's C++ ops (CPU Adam, shared-memory comm, async I/O, pinned memory) ahead of use.

They otherwise compile on first use, minutes each on a small machine, inside a training job or a
test's timed launch. ``tests/conftest.py`` runs this once, before the first test, with
``TORCH_EXTENSIONS_DIR`` set to the venv's own folder (``.venv/torch_extensions``): torch
caches an op by its name only, so two checkouts sharing ``~/.cache/torch_extensions`` rewrite each
other's build (other paths, same name) and each recompiles over the other.

torch runs the first ``ninja`` on PATH; this script puts its own interpreter's ``bin`` first, as
an activated venv does and as ``tests/conftest.py`` does for the tests: a system ninja of another
version (1.11 here, against the venv's 1.13) hashes commands differently, reads the other's build
log as stale and recompiles every op.

The builders are the accelerator's, the ones DeepSpeed itself loads; a builder of the same op name
from elsewhere has other flags and the next load would rebuild. ``--check`` loads every op again in
this fresh process and fails if any was rebuilt, which is what a test worker would otherwise pay.
Run it when nothing else builds into the cache: it first removes lock files a killed build left
behind (torch's loader waits for them to go away, with no time limit).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from deepspeed.accelerator import get_accelerator

BUILDERS = ("CPUAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder", "PinMemoryBuilder")


def ensure_libaio() -> None:
    """NVMe offload (ZeRO-Infinity) needs libaio's headers to build the async I/O op: installed with apt when
    this runs as root (this project's machines); elsewhere the op is skipped and ``offload='nvme'`` unavailable."""
    if Path("/usr/include/libaio.h").exists() or not shutil.which("apt-get") or os.geteuid() != 0:
        return
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "libaio-dev"]
    if subprocess.run(install, **quiet).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], **quiet)
        if subprocess.run(install, **quiet).returncode != 0:
            print(
                "build_deepspeed_ops: libaio-dev not installed; offload='nvme' will be unavailable",
                file=sys.stderr,
            )


def load_all() -> list[str]:
    """Load (building where needed) every op this machine can build; their names."""
    loaded = []
    for name in BUILDERS:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)
            loaded.append(builder.name)
    return loaded


def damaged_builds(cache: Path) -> list[Path]:
    """Op folders whose next load would rebuild although nothing changed: ninja (the one torch runs) still sees
    work in them. Seen after a build killed mid-write: a truncated ``.ninja_deps`` ("premature end of file")
    made every later load recompile the op, inside the tests' timed launches."""
    damaged = []
    for build_file in sorted(cache.glob("*/build.ninja")):
        folder = build_file.parent
        result = subprocess.run(["ninja", "-n", "-C", str(folder)], capture_output=True, text=True)
        if result.returncode != 0 or "no work to do" not in result.stdout:
            damaged.append(folder)
    return damaged


def built_libraries(cache: Path) -> dict[Path, int]:
    return {so: so.stat().st_mtime_ns for so in cache.rglob("*.so")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if loading rebuilds any op")
    args = parser.parse_args()
    interpreter_bin = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join(filter(None, [interpreter_bin, os.environ.get("PATH")]))
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    for lock in cache.glob("*/lock"):  # left by a build that was killed: torch would wait on it forever
        print(f"build_deepspeed_ops: removing the stale {lock}")
        lock.unlink()
    ensure_libaio()
    before = built_libraries(cache)
    loaded = load_all()
    if not args.check and shutil.which("ninja"):
        for folder in damaged_builds(cache):  # rebuilt from scratch once, so the check below finds it stable
            print(
                f"build_deepspeed_ops: {folder} would rebuild at every load; building it again from scratch"
            )
            shutil.rmtree(folder)
        loaded = load_all()
    rebuilt = sorted(so.stem for so, mtime in built_libraries(cache).items() if before.get(so) != mtime)
    if args.check and rebuilt:
        raise SystemExit(
            f"build_deepspeed_ops: loading again rebuilt {rebuilt} in {cache}; the tests would too"
        )
    verb = "checked (no rebuild)" if args.check else "ready"
    print(f"build_deepspeed_ops: {', '.join(loaded)} {verb} in {cache}")


if __name__ == "__main__":
    main()
