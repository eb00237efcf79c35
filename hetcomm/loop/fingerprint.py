"""Fingerprints of training data, for a checkpoint to record what it was trained on: a
resume on data that changed under the same name (regenerated, edited, cut short, with
the same number of samples) is then refused instead of trained on.

A fingerprint is the SHA-256 of every byte: a sample of blocks would miss an edit between
them. It runs at about 1 GB/s on one core (the 2-core CI machine, 2026-12-04), so a large
corpus's fingerprint is worth caching (hetcomm.train.data_fingerprint does, keyed by the
file's size and modification time)."""

import hashlib
from collections.abc import Iterable
from pathlib import Path

BLOCK_BYTES = 16 * 2**20


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, as `sha256sum` prints it."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def fingerprint_files(paths: Iterable[str | Path]) -> str:
    """One file's SHA-256 (what `sha256sum` prints); of several, the SHA-256 of their
    SHA-256s in the order given, so that bytes moved from one file to the next, or
    files swapped, differ."""
    each = [file_sha256(path) for path in paths]
    if not each:
        raise ValueError("fingerprint_files: paths is empty; expected at least one file")
    return each[0] if len(each) == 1 else hashlib.sha256(" ".join(each).encode()).hexdigest()
