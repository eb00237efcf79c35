"""Token data for the trainer: byte-level text or pre-tokenised uint16 files, cut into
fixed-length training windows. The default corpus is the source of Python's own
standard library, which exists wherever Python does: nothing is downloaded.

Files are memory-mapped, never read whole: a batch copies only its own windows, so
nanoGPT's ~17 GB OpenWebText train.bin starts as fast, and in as little memory, as a
small file. The vocabulary is --vocab-size when given; otherwise 256 for byte data, and
for a .bin file its largest token id + 1, found by a scan that only files of up to
VOCAB_SCAN_MAX_TOKENS tokens get: a larger one needs --vocab-size."""

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_CORPUS_BYTES = 4 * 2**20
# A scan for the largest token id reads every page of the file: a few ms for 64 MiB in
# the page cache, a disk read of the whole file otherwise, and the pages count in every
# rank's resident memory. A larger file is almost always a real tokenizer's output whose
# vocabulary the user knows: GPT-2's 50257 for nanoGPT's prepared data sets.
VOCAB_SCAN_MAX_TOKENS = 2**25
GPT2_VOCAB_SIZE = 50257


def default_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> tuple[np.ndarray, str]:
    """The standard library's top-level .py files in name order, as bytes (the exact
    text depends on the Python version)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data[: max_bytes - size])
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    if size == 0:
        raise FileNotFoundError(f"no Python sources under {stdlib} to use as the default corpus; pass --data")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8), f"Python {sysconfig.get_python_version()} stdlib sources"


def load_tokens(path: str | Path) -> tuple[np.ndarray, str]:
    """A read-only memory map of a .bin file of uint16 token ids (as nanoGPT's prepare
    scripts write), or of any other file as UTF-8/bytes text tokenised byte by byte."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"--data {path}: a directory; expected a file (text, or a .bin of uint16 tokens)")
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"--data {path}: the file is empty")
    if path.suffix == ".bin":
        if size % 2:
            raise ValueError(f"--data {path}: a .bin file must hold uint16 tokens (an even number of bytes)")
        return np.memmap(path, dtype=np.uint16, mode="r"), f"{path.name} (uint16 tokens)"
    return np.memmap(path, dtype=np.uint8, mode="r"), f"{path.name} (bytes)"


def load_windows(data: str | Path | None, block_size: int,
                 vocab_size: int | None = None) -> tuple["TokenWindows", str]:
    """The training windows of --data (default: the standard-library corpus) and the
    data's description, which checkpoints record to recognise their run."""
    tokens, description = load_tokens(data) if data else default_corpus()
    return TokenWindows(tokens, block_size, vocab_size), description


def inferred_vocab_size(tokens: np.ndarray) -> int:
    """256 for bytes; for token ids, the largest + 1 if the data is small enough to scan."""
    if tokens.dtype == np.uint8:
        return 256
    if tokens.size > VOCAB_SCAN_MAX_TOKENS:
        raise ValueError(f"--data holds {tokens.size:,} tokens, more than the {VOCAB_SCAN_MAX_TOKENS:,} scanned at "
                         f"start-up for the largest token id; pass --vocab-size ({GPT2_VOCAB_SIZE} for GPT-2's "
                         f"tokenizer, which nanoGPT's prepared .bin files use)")
    return int(tokens.max()) + 1


@dataclass
class TokenWindows:
    """Sample i is the window tokens[i*T : i*T + T + 1]: inputs are its first T tokens,
    targets the last T. Windows do not overlap, so every token is a target once.
    vocab_size None: inferred from the tokens (see inferred_vocab_size)."""

    tokens: np.ndarray
    block_size: int
    vocab_size: int | None = None

    def __post_init__(self):
        if len(self) < 1:
            raise ValueError(f"the data has {self.tokens.size} tokens: too few for one window of "
                             f"{self.block_size + 1}; use a larger file or a smaller --block-size")
        if self.vocab_size is None:
            self.vocab_size = inferred_vocab_size(self.tokens)

    def __len__(self) -> int:
        return (self.tokens.size - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch([index])
        return inputs[0], targets[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The windows at `indices` as (inputs, targets) pairs, copied out of the tokens in
        one batch (what a DataLoader, and hetcomm.loop, fetch a batch with)."""
        inputs, targets = self.batch(indices)
        return list(zip(inputs, targets))

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of these windows, as int64 tensors [len(indices), T]."""
        if not indices:
            empty = torch.empty(0, self.block_size, dtype=torch.int64)
            return empty, empty
        starts = np.asarray(indices, dtype=np.int64) * self.block_size
        # Fancy indexing copies just these windows out of the memory map.
        rows = self.tokens[starts[:, None] + np.arange(self.block_size + 1)].astype(np.int64)
        self._check_vocabulary(indices, rows)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    def _check_vocabulary(self, indices: list[int], rows: np.ndarray) -> None:
        """A token id the embedding has no row for would fail deep in the model's
        forward (an index error, or a device-side assert on CUDA); name it here."""
        largest = rows.max(axis=1)
        if largest.max() < self.vocab_size:
            return
        row = int(np.argmax(largest >= self.vocab_size))
        raise ValueError(f"window {indices[row]} of the data holds token id {int(largest[row])}, but --vocab-size is "
                         f"{self.vocab_size}: every id must be below it; set --vocab-size to the vocabulary of the "
                         f"tokenizer that wrote --data")
