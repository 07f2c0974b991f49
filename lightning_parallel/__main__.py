"""``python -m lightning_parallel plan ...`` (also installed as ``lightning-parallel``); see ``cli.py``."""

from __future__ import annotations

import sys

from lightning_parallel.cli import main

if __name__ == "__main__":
    sys.exit(main())
