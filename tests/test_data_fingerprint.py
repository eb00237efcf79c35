"""The data fingerprint checkpoints record (hetcomm.train.data_fingerprint): the SHA-256
of every byte of --data, cached in the run directory while the file's path, size and
modification time hold, so that only a changed file is read again."""

import hashlib
import os

import numpy as np
import pytest

from hetcomm.loop.fingerprint import BLOCK_BYTES, fingerprint_files
from hetcomm.train import data_fingerprint as fingerprints


def counting_hashes(monkeypatch) -> list:
    hashed = []
    real = fingerprints.file_sha256

    def counted(path):
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(fingerprints, "file_sha256", counted)
    return hashed


def test_a_file_is_hashed_whole_and_once_while_it_is_unchanged(tmp_path, monkeypatch):
    data, run = tmp_path / "corpus.txt", tmp_path / "run"
    run.mkdir()
    content = os.urandom(3 * BLOCK_BYTES // 2)   # more than one block
    data.write_bytes(content)
    hashed = counting_hashes(monkeypatch)
    first = fingerprints.data_fingerprint(str(data), np.zeros(1, np.uint8), run)
    assert first["sha256"] == hashlib.sha256(content).hexdigest() and first["size"] == len(content)
    fingerprints.remember_fingerprint(first, run)
    assert fingerprints.data_fingerprint(str(data), np.zeros(1, np.uint8), run) == first
    assert len(hashed) == 1


def test_a_file_written_again_is_hashed_again(tmp_path, monkeypatch):
    data, run = tmp_path / "corpus.txt", tmp_path / "run"
    run.mkdir()
    data.write_bytes(b"a" * 100)
    first = fingerprints.data_fingerprint(str(data), np.zeros(1, np.uint8), run)
    fingerprints.remember_fingerprint(first, run)
    data.write_bytes(b"b" * 100)   # the same size
    os.utime(data, ns=(first["mtime_ns"] + 10**9, first["mtime_ns"] + 10**9))
    hashed = counting_hashes(monkeypatch)
    second = fingerprints.data_fingerprint(str(data), np.zeros(1, np.uint8), run)
    assert len(hashed) == 1 and second["sha256"] == hashlib.sha256(b"b" * 100).hexdigest()


def test_a_damaged_cache_is_hashed_past_and_no_run_directory_is_made(tmp_path):
    data, run = tmp_path / "corpus.txt", tmp_path / "run"
    data.write_bytes(b"abc")
    fingerprints.remember_fingerprint(fingerprints.data_fingerprint(str(data), np.zeros(1, np.uint8), run), run)
    assert not run.exists()   # the launcher checks a resume before the run directory exists
    run.mkdir()
    (run / fingerprints.CACHE_NAME).write_text("{not json")
    assert fingerprints.data_fingerprint(str(data), np.zeros(1, np.uint8), run)["sha256"] == \
        hashlib.sha256(b"abc").hexdigest()


def test_the_default_corpus_is_hashed_from_its_tokens():
    tokens = np.frombuffer(b"hello", dtype=np.uint8)
    assert fingerprints.data_fingerprint(None, tokens, "unused") == {"sha256": hashlib.sha256(b"hello").hexdigest()}


def test_files_are_fingerprinted_as_sha256sum_and_in_their_order(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"abc")
    b.write_bytes(b"def")
    assert fingerprint_files([a]) == hashlib.sha256(b"abc").hexdigest()
    both = fingerprint_files([a, b])
    assert both == hashlib.sha256(f"{fingerprint_files([a])} {fingerprint_files([b])}".encode()).hexdigest()
    assert both != fingerprint_files([b, a])
    a.write_bytes(b"abcd")
    b.write_bytes(b"ef")   # the same bytes in all, moved from one file to the next
    assert fingerprint_files([a, b]) != both
    with pytest.raises(ValueError, match="paths is empty"):
        fingerprint_files([])
