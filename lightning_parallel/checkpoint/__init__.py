"""Checkpoint pieces the strategy builds on: atomic writes, resumable data loaders, and moving weights in and
out of the sharded format (one plain file in, one consolidated safetensors file out)."""
