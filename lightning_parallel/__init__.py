"""lightning_parallel: tensor, sequence, pipeline and expert parallelism for unchanged LightningModules.

Importing the package registers the strategy with Lightning, so that
``Trainer(strategy="hybrid_parallel")`` and the presets (``"tp2"``, ``"tp2_sp"``, ``"tp_auto"``)
work by name, also from ``LightningCLI`` YAML files.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.checkpoint.transfer import consolidate_checkpoint, export_checkpoint, load_weights
from lightning_parallel.comm import PowerSGD
from lightning_parallel.compression import KnowledgeDistillation, MagnitudePruning, QuantizationAwareTraining
from lightning_parallel.launch import SLURMAutoRequeue
from lightning_parallel.memory import ActivationMemoryMonitor
from lightning_parallel.mesh import ParallelDims
from lightning_parallel.plans import ParallelPlan, auto_plan
from lightning_parallel.strategy import HybridParallelStrategy
from lightning_parallel.zero.arguments import ImportanceSplit

if HybridParallelStrategy.strategy_name not in StrategyRegistry:
    HybridParallelStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "ActivationMemoryMonitor",
    "HybridParallelStrategy",
    "ImportanceSplit",
    "KnowledgeDistillation",
    "MagnitudePruning",
    "ParallelDims",
    "ParallelPlan",
    "PowerSGD",
    "QuantizationAwareTraining",
    "SLURMAutoRequeue",
    "auto_plan",
    "consolidate_checkpoint",
    "export_checkpoint",
    "load_weights",
]
