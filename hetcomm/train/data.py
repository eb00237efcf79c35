"""Token data for the trainer: byte-level text or pre-tokenised uint16 files, cut into
fixed-length training windows. The default corpus is the source of Python's own
standard library, which exists wherever Python does: nothing is downloaded."""

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DEFAULT_CORPUS_BYTES = 4 * 2**20


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
    """A .bin file of uint16 token ids (as nanoGPT's prepare scripts write), or any
    other file as UTF-8/bytes text tokenised byte by byte."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    if path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise ValueError(f"--data {path}: a .bin file must hold uint16 tokens (an even number of bytes)")
        return np.fromfile(path, dtype=np.uint16), f"{path.name} (uint16 tokens)"
    return np.fromfile(path, dtype=np.uint8), f"{path.name} (bytes)"


@dataclass
class TokenWindows:
    """Sample i is the window tokens[i*T : i*T + T + 1]: inputs are its first T tokens,
    targets the last T. Windows do not overlap, so every token is a target once."""

    tokens: np.ndarray
    block_size: int

    def __post_init__(self):
        if len(self) < 1:
            raise ValueError(f"the data has {self.tokens.size} tokens: too few for one window of "
                             f"{self.block_size + 1}; use a larger file or a smaller --block-size")

    def __len__(self) -> int:
        return (self.tokens.size - 1) // self.block_size

    @property
    def vocab_size(self) -> int:
        return 256 if self.tokens.dtype == np.uint8 else int(self.tokens.max()) + 1

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of these windows, as int64 tensors [len(indices), T]."""
        if not indices:
            empty = torch.empty(0, self.block_size, dtype=torch.int64)
            return empty, empty
        starts = np.asarray(indices, dtype=np.int64) * self.block_size
        rows = np.stack([self.tokens[s: s + self.block_size + 1] for s in starts]).astype(np.int64)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]
