"""Unit tests of lightning_parallel.mesh (no process group)."""
