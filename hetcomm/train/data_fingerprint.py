"""The fingerprint of the training data that a checkpoint records, so that a resume on
data that changed under the same name (regenerated, edited, cut short) is refused
instead of trained on: the window count alone misses an edit of the same length.

A file's fingerprint is the SHA-256 of all its bytes (hetcomm.loop.fingerprint). Hashing
reads the whole file (about 1 GB/s on one core of the 2-core CI machine, measured
2026-12-04: ~17 s for nanoGPT's 17 GB OpenWebText, plus reading it from disk), so the
result is cached in the run directory, keyed by the file's path, size
and modification time: resuming on an unchanged file reads none of it, and a file
rewritten or edited in place (a new mtime) is hashed again. The default corpus is hashed
from memory (4 MiB)."""

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from hetcomm.loop.fingerprint import file_sha256

CACHE_NAME = "data-fingerprint.json"


def tokens_sha256(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens).view(np.uint8).tobytes()).hexdigest()


def data_fingerprint(data: str | None, tokens: np.ndarray, run_dir: str | Path) -> dict:
    """{"sha256": ...} of --data's bytes, with the path, size and modification time of the
    file it was taken from (from run_dir's cache while they still match: see the
    module); of the default corpus's tokens when no file is given."""
    if not data:
        return {"sha256": tokens_sha256(tokens)}
    path = Path(data).resolve()
    stat = path.stat()   # before hashing: a file changed meanwhile misses the cache next time
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        cached = json.loads((Path(run_dir) / CACHE_NAME).read_text())
        if {k: cached.get(k) for k in key} == key and isinstance(cached.get("sha256"), str):
            return {**key, "sha256": cached["sha256"]}
    except (OSError, ValueError):
        pass   # no cache, or an unreadable one: hash the file
    return {**key, "sha256": file_sha256(path)}


def remember_fingerprint(record: dict, run_dir: str | Path) -> None:
    """Caches a file's fingerprint in run_dir, an existing run directory, for the next
    resume. Written whole or not at all; a directory that cannot be written only costs
    the next resume a hash."""
    if "path" not in record:
        return
    try:
        descriptor, temporary = tempfile.mkstemp(dir=run_dir, prefix=".data-fingerprint-", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "w") as f:
            json.dump(record, f)
        os.replace(temporary, Path(run_dir) / CACHE_NAME)
    except OSError:
        Path(temporary).unlink(missing_ok=True)
