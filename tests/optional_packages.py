"""Optional packages installed beside the venv (``scripts/setup_env.sh``: ``.venv/extras``).

torchao lives there rather than in the venv because Hugging Face transformers imports it in
every process where it can be found (seconds per process, warnings). The tests that need it, and
the scripts they launch, call :func:`use_optional_packages` first.
"""

from __future__ import annotations

import sys
from pathlib import Path

EXTRAS = Path(__file__).resolve().parents[1] / ".venv" / "extras"


def use_optional_packages() -> None:
    if EXTRAS.is_dir() and str(EXTRAS) not in sys.path:
        sys.path.append(str(EXTRAS))
