"""GPT recipe: a plain GPT-2 style LightningModule, a token DataModule and the CLI to train them.

Nothing in this package knows about parallelism; see ``docs/recipes/gpt.md``.
"""

from recipes.gpt.callbacks import TokensPerSecond, sequences_in_batch, tokens_in_batch
from recipes.gpt.data import TokenDataModule
from recipes.gpt.model import GPT, GPTConfig
from recipes.gpt.module import GPTLightningModule
from recipes.gpt.tokenizer import ByteTokenizer

__all__ = [
    "GPT",
    "ByteTokenizer",
    "GPTConfig",
    "GPTLightningModule",
    "TokenDataModule",
    "TokensPerSecond",
    "sequences_in_batch",
    "tokens_in_batch",
]
