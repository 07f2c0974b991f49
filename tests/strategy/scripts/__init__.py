"""Scripts run as separate processes (one per rank) by ``tests.strategy.launch``."""
