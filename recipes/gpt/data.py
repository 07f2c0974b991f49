"""Token data for the GPT recipe: the embedded corpus by default, or a ``.bin`` from prepare.py.

Everything here is ordinary Lightning: plain ``DataLoader`` objects, no samplers. When the
job runs on several ranks, Lightning swaps in a ``DistributedSampler`` built from the
strategy's ``distributed_sampler_kwargs``, which is how a parallel strategy decides which
ranks get different batches (data-parallel) and which get the same one (tensor-parallel).
"""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from recipes.gpt.prepare import TOKEN_DTYPE
from recipes.gpt.tokenizer import ByteTokenizer

EMBEDDED_CORPUS = "data/corpus.txt.gz"  # inside the ``recipes.gpt`` package; see make_corpus.py


def load_embedded_corpus() -> np.ndarray:
    """Token ids of the corpus shipped with the package (no network), as ``uint16``."""
    raw = resources.files("recipes.gpt").joinpath(EMBEDDED_CORPUS).read_bytes()
    text = gzip.decompress(raw).decode("utf-8")
    return np.array(ByteTokenizer().encode(text), dtype=TOKEN_DTYPE)


def load_token_file(path: str | Path) -> np.ndarray:
    """Token ids from a file written by ``prepare.py``: raw ``uint16``, memory-mapped.

    Memory-mapping keeps host memory flat however large the file is: only the windows a
    batch touches are read from disk.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"`data_path={str(path)!r}` does not exist. Create it with `python -m recipes.gpt.prepare`."
        )
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


class TokenWindows(Dataset):
    """Non-overlapping windows of ``block_size`` tokens with their next-token targets.

    Window ``i`` covers ``tokens[i*T : i*T + T + 1]``; ``x`` is its first ``T`` tokens and
    ``y`` the last ``T``, so ``y[t]`` is the token that follows ``x[t]``. The last token of
    one window's ``y`` is the first of the next window's ``x``, so no target is wasted.
    """

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(
                f"{len(tokens)} tokens cannot fill one window of block_size={block_size} (+1 for the"
                f" target). Use more text, a smaller `block_size`, or a smaller `val_fraction`."
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.block_size
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))  # (T+1,)
        return chunk[:-1], chunk[1:]  # x: (T,), y: (T,)


class TokenDataModule(L.LightningDataModule):
    """Train/validation windows over one token stream, split at ``1 - val_fraction``.

    Args:
        data_path: A ``.bin`` token file from ``python -m recipes.gpt.prepare``; ``None``
            uses the small corpus embedded in the package.
        block_size: Tokens per training sequence. The CLI links it to ``model.block_size``.
        batch_size: Sequences per batch on each data-parallel replica.
        val_fraction: Tail of the token stream held out for validation.
        num_workers: DataLoader worker processes.
        shuffle: Shuffle the training windows. Parity tests turn it off so that a parallel
            run and a single-process run see the same batches in the same order.
        pin_memory: Pin host memory for faster host-to-GPU copies.
    """

    def __init__(
        self,
        data_path: str | None = None,
        block_size: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        shuffle: bool = True,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"`block_size={block_size}` and `batch_size={batch_size}` must be positive.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"`val_fraction={val_fraction}` must be strictly between 0 and 1.")
        self.save_hyperparameters()
        self.data_path = data_path
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.pin_memory = pin_memory
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load the tokens and split them. Every rank does this; it is cheap (no download)."""
        if self.train_set is not None:
            return
        tokens = load_embedded_corpus() if self.data_path is None else load_token_file(self.data_path)
        split = int(len(tokens) * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.block_size)
        self.val_set = TokenWindows(tokens[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() runs before the dataloaders are requested"
        # drop_last: every step sees a full batch, so shapes stay static (pipeline
        # micro-batches, compiled graphs) and parallel layouts divide the batch evenly.
        # Validation drops its last partial batch for the same reason (at most batch_size - 1
        # windows out of hundreds).
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() runs before the dataloaders are requested"
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )
