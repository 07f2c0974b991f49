"""Unit tests of lightning_parallel.plans (no process group)."""
