"""lightning_parallel: tensor, sequence, pipeline and expert parallelism for unchanged LightningModules."""

__all__: list[str] = []
