"""The trainer's data: files are memory-mapped, batches copy only their windows and match
a plain read of the file, the vocabulary is --vocab-size or a bounded inference, and bad
files or settings stop with one message that names them."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from hetcomm.train import data as data_module
from hetcomm.train import launch
from hetcomm.train.config import TrainConfig, from_args, parser, validate
from hetcomm.train.data import GPT2_VOCAB_SIZE, TokenWindows, load_tokens, load_windows

SPARSE_BYTES = 3 * 2**30
HEAD = np.arange(1000, 1300, dtype=np.uint16)
TAIL = np.arange(50000, 50257, dtype=np.uint16)


@pytest.fixture(scope="module")
def sparse_bin(tmp_path_factory):
    """A 3 GiB .bin file that costs no disk: real tokens at the start and the end, a hole
    of zeros between."""
    path = tmp_path_factory.mktemp("sparse") / "train.bin"
    with open(path, "wb") as f:
        f.write(HEAD.tobytes())
        f.truncate(SPARSE_BYTES - TAIL.nbytes)
        f.seek(0, 2)
        f.write(TAIL.tobytes())
    return path


def plain_windows(path, dtype, block_size, indices):
    """What a batch must hold, read with seek and np.fromfile."""
    item = np.dtype(dtype).itemsize
    rows = []
    with open(path, "rb") as f:
        for i in indices:
            f.seek(i * block_size * item)
            rows.append(np.fromfile(f, dtype=dtype, count=block_size + 1))
    return np.stack(rows).astype(np.int64)


# Run in a fresh interpreter so that what earlier tests mapped or allocated does not count.
OPEN_AND_BATCH = """
import json, sys, time
from hetcomm.train.data import load_windows

def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

before = resident_bytes()
start = time.perf_counter()
windows, description = load_windows(sys.argv[1], 128, 50257)
inputs, targets = windows.batch([0, len(windows) // 2, len(windows) - 1])
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "grown": resident_bytes() - before, "windows": len(windows),
                  "description": description, "first": inputs[0, :5].tolist(), "last": targets[2, -5:].tolist()}))
"""


def test_a_multi_gigabyte_file_opens_in_little_time_and_memory(sparse_bin):
    run = subprocess.run([sys.executable, "-c", OPEN_AND_BATCH, str(sparse_bin)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["seconds"] < 0.5
    assert result["grown"] < 4 * 2**20          # np.fromfile would have read all 3 GiB
    tokens = SPARSE_BYTES // 2
    assert result["windows"] == (tokens - 1) // 128
    assert result["description"] == "train.bin (uint16 tokens)"
    last_target = result["windows"] * 128 - (tokens - TAIL.size)    # its place in TAIL
    assert result["first"] == HEAD[:5].tolist() and result["last"] == TAIL[last_target - 4: last_target + 1].tolist()


def test_batches_of_the_multi_gigabyte_file_match_a_plain_read(sparse_bin):
    windows, _ = load_windows(sparse_bin, 128, GPT2_VOCAB_SIZE)
    indices = [len(windows) - 1, 0, 1, 7_000_000, 0, len(windows) - 2]
    inputs, targets = windows.batch(indices)
    expected = plain_windows(sparse_bin, np.uint16, 128, indices)
    assert np.array_equal(inputs.numpy(), expected[:, :-1]) and np.array_equal(targets.numpy(), expected[:, 1:])


def test_a_large_bin_file_without_vocab_size_is_not_scanned(sparse_bin):
    with pytest.raises(ValueError, match=r"--data holds 1,610,612,736 tokens, more than the 33,554,432 scanned .*"
                                         r"pass --vocab-size \(50257 for GPT-2's tokenizer"):
        load_windows(sparse_bin, 128)


@pytest.mark.parametrize("suffix, dtype", [(".bin", np.uint16), (".txt", np.uint8)])
@pytest.mark.parametrize("block_size", [1, 7, 64])
def test_batches_match_a_plain_read(tmp_path, suffix, dtype, block_size):
    path = tmp_path / f"tokens{suffix}"
    high = 50257 if dtype == np.uint16 else 256
    np.random.default_rng(block_size).integers(0, high, 1001, dtype=dtype).tofile(path)
    windows, _ = load_windows(path, block_size)
    assert len(windows) == 1000 // block_size
    indices = [len(windows) - 1, 0, 3 % len(windows), 0]
    inputs, targets = windows.batch(indices)
    expected = plain_windows(path, dtype, block_size, indices)
    assert inputs.dtype == targets.dtype == torch.int64
    assert np.array_equal(inputs.numpy(), expected[:, :-1]) and np.array_equal(targets.numpy(), expected[:, 1:])
    assert windows.batch([])[0].shape == (0, block_size)


def test_files_are_memory_mapped_and_described_as_before(tmp_path):
    (tmp_path / "a.bin").write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    (tmp_path / "a.txt").write_bytes(b"hello")
    tokens, description = load_tokens(tmp_path / "a.bin")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and description == "a.bin (uint16 tokens)"
    tokens, description = load_tokens(tmp_path / "a.txt")
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint8 and description == "a.txt (bytes)"


def test_vocabulary_inferred_without_vocab_size(tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(np.array([3, 900, 5, 7], dtype=np.uint16).tobytes())
    (tmp_path / "a.txt").write_bytes(b"abcd")
    assert load_windows(tmp_path / "a.bin", 2)[0].vocab_size == 901
    assert load_windows(tmp_path / "a.txt", 2)[0].vocab_size == 256
    assert load_windows(None, 16)[0].vocab_size == 256
    monkeypatch.setattr(data_module, "VOCAB_SCAN_MAX_TOKENS", 3)
    with pytest.raises(ValueError, match="--data holds 4 tokens, more than the 3 scanned"):
        load_windows(tmp_path / "a.bin", 2)
    assert load_windows(tmp_path / "a.bin", 2, 1000)[0].vocab_size == 1000


def test_a_token_at_or_above_vocab_size_names_its_window(tmp_path):
    tokens = np.zeros(41, dtype=np.uint16)
    tokens[25] = 100                              # in window 3 of 8 tokens (tokens 24 to 32) only
    path = tmp_path / "a.bin"
    tokens.tofile(path)
    windows, _ = load_windows(path, 8, 100)
    windows.batch([0, 1, 4])
    with pytest.raises(ValueError, match=r"window 3 of the data holds token id 100, but --vocab-size is 100"):
        windows.batch([1, 3, 2])
    assert load_windows(path, 8, 101)[0].batch([3])[0].max() == 100


def test_byte_data_above_a_small_vocab_size_is_refused():
    windows = TokenWindows(np.frombuffer(b"abcdefghij", dtype=np.uint8), 4, vocab_size=98)
    with pytest.raises(ValueError, match=r"window 0 of the data holds token id 101, but --vocab-size is 98"):
        windows.batch([0])


@pytest.mark.parametrize("name, content, message", [
    ("empty.bin", b"", "the file is empty"),
    ("empty.txt", b"", "the file is empty"),
    ("odd.bin", b"\x01\x00\x02", "a .bin file must hold uint16 tokens (an even number of bytes)"),
    ("one.bin", b"\x01\x00", "the data has 1 tokens: too few for one window"),
])
def test_bad_files_stop_with_one_message(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError) as error:
        load_windows(tmp_path / name, 4, GPT2_VOCAB_SIZE)
    assert message in str(error.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--data .*missing.bin: no such file"):
        load_windows(tmp_path / "missing.bin", 4)


def test_vocab_size_option_is_parsed_and_checked():
    assert from_args(parser().parse_args([])).vocab_size is None
    config = from_args(parser().parse_args(["--vocab-size", "50257"]))
    assert config.vocab_size == 50257
    validate(config, 2)
    with pytest.raises(ValueError, match=r"--vocab-size must be a positive integer; got 2.5"):
        validate(TrainConfig(vocab_size=2.5), 2)


@pytest.mark.parametrize("value, message", [
    ("0", "--vocab-size must be a positive integer; got 0"),
    ("-5", "--vocab-size must be a positive integer; got -5"),
    ("50k", "argument --vocab-size: invalid int value: '50k'"),
])
def test_bad_vocab_size_stops_the_command_with_one_message(tmp_path, value, message, capsys):
    with pytest.raises(SystemExit) as stop:
        launch.main(["--nproc", "2", "--global-batch", "8", "--out", str(tmp_path / "run"), f"--vocab-size={value}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
