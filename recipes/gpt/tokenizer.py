"""Byte-level tokenizer: every UTF-8 byte is one token.

Why bytes: no vocabulary file to download or train, any text (any language, emoji, code) is
encodable, and decoding is exact. The cost is longer sequences than BPE, which is fine for
a recipe whose job is to exercise parallel training, not to reach state-of-the-art loss.

The tokenizer has 256 ids, but the model's embedding is padded to ``vocab_size=320`` in the
configs (see :data:`PADDED_VOCAB_SIZE`): the ids 256..319 never occur in the data, and the
model quickly learns to give them near-zero probability.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

BYTE_VOCAB_SIZE = 256
# 320 = 5 x 64: a multiple of 64 so that tensor-parallel degrees (2, 4, 8, ...) divide the
# vocabulary dimension of the embedding and of the LM head evenly, and matmuls stay aligned.
PADDED_VOCAB_SIZE = 320


class ByteTokenizer:
    """Encode text as its UTF-8 bytes and decode token ids back to text."""

    vocab_size: int = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes, each in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D ``int64`` tensor, ready to feed the model."""
        return torch.tensor(self.encode(text), dtype=torch.long)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Text of ``ids``.

        Ids outside the byte range (a sampled padding id >= 256) are dropped, and byte runs
        that are not valid UTF-8 (a multi-byte character cut by sampling) become U+FFFD, so
        decoding a model's sample never raises.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB_SIZE).decode("utf-8", errors="replace")
