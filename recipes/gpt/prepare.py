"""Turn any UTF-8 text file into a token file the GPT recipe can train on.

Usage::

    python -m recipes.gpt.prepare input.txt output.bin
    python -m recipes.gpt fit --config recipes/gpt/configs/tiny.yaml --data.data_path output.bin

The output is the byte-level token ids (see ``tokenizer.py``) of the whole file, stored
back to back as raw little-endian ``uint16``, no header, the format nanoGPT uses. The data
module memory-maps it (``numpy.memmap(path, dtype=numpy.uint16)``), so files larger than
host memory work, and its last ``val_fraction`` becomes the validation set.

The file is read in chunks of characters, so memory stays flat however large it is; byte
tokens of consecutive chunks concatenate to exactly the tokens of the whole text. Line
endings are kept as they are (``newline=""``): the tokens are the file's bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from recipes.gpt.tokenizer import ByteTokenizer

TOKEN_DTYPE = np.dtype("<u2")  # uint16: room for vocabularies up to 65,536 ids
CHUNK_CHARS = 1 << 22  # 4 Mi characters per read


def prepare(input_path: str | Path, output_path: str | Path) -> int:
    """Tokenize ``input_path`` into ``output_path``; returns the number of tokens written."""
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise ValueError(f"Input text file {str(input_path)!r} does not exist.")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = ByteTokenizer()
    num_tokens = 0
    with open(input_path, encoding="utf-8", newline="") as src, open(output_path, "wb") as dst:
        while chunk := src.read(CHUNK_CHARS):
            ids = np.array(tokenizer.encode(chunk), dtype=TOKEN_DTYPE)
            ids.tofile(dst)
            num_tokens += ids.size
    return num_tokens


def main(argv: list[str] | None = None) -> None:
    """Command line entry: ``python -m recipes.gpt.prepare INPUT OUTPUT``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("input", type=Path, help="UTF-8 text file")
    parser.add_argument("output", type=Path, help="token file to write (e.g. data/my_text.bin)")
    args = parser.parse_args(argv)
    num_tokens = prepare(args.input, args.output)
    print(f"wrote {num_tokens:,} tokens to {args.output}")


if __name__ == "__main__":
    main()
