"""MoE recipe: a GPT whose MLPs are Mixtures of Experts, as a plain LightningModule, and its CLI.

The data is the GPT recipe's; nothing in this package knows about parallelism. See
``docs/experts.md``.
"""

from recipes.moe.callbacks import ExpertLoad
from recipes.moe.model import MoEBlock, MoEGPT, MoEGPTConfig
from recipes.moe.module import MoEGPTLightningModule

__all__ = ["ExpertLoad", "MoEBlock", "MoEGPT", "MoEGPTConfig", "MoEGPTLightningModule"]
