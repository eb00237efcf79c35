"""Bad input to `hetcomm train`, `report` and `plan --profile` stops with one line
(exit 2, no traceback, nothing written) before any process starts; a failure inside a
rank reaches the user as one line naming the rank, its traceback only with --debug."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import hetcomm
from hetcomm.plan import cli as plan_cli
from hetcomm.train import launch, report
from hetcomm.train.launch import speedup_words

TEXT = ("def greet(name):\n    return 'hello ' + name\n\nclass Point:\n    x = 0\n    y = 0\n" * 60).encode()
SMALL_MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16"]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    """Inputs the table names by file: a corpus, and data that cannot train."""
    (tmp_path / "corpus.txt").write_bytes(TEXT)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    (tmp_path / "tiny.txt").write_bytes(b"0123456789")
    np.arange(400, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    (tmp_path / "a-file").write_text("kept\n")
    return tmp_path


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root with a file's content, to show that nothing was written."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def train_refused(root: Path, arguments: list[str], capsys) -> str:
    """Runs `hetcomm train` in this process (it must stop before spawning anything) and
    returns its stderr, after checking exit code 2, one line, and nothing written."""
    before = snapshot(root)
    common = ["--nproc", "2", "--global-batch", "8", *SMALL_MODEL, "--data", str(root / "corpus.txt"),
              "--out", str(root / "run")]
    with pytest.raises(SystemExit) as stop:
        launch.main([*common, *(a.format(tmp=root) for a in arguments)])
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert err.startswith("hetcomm train: error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert snapshot(root) == before
    return err


NOT_FINITE = [(option, value) for option in ("--lr", "--min-lr", "--weight-decay", "--grad-clip", "--loss-scale",
                                             "--rebalance-threshold", "--dropout")
              for value in ("nan", "inf")] + [("--lr", "-inf")]


@pytest.mark.parametrize("arguments, message", [
    # data
    (["--data", "{tmp}/missing.txt"], "missing.txt: no such file"),
    (["--data", "{tmp}"], ": a directory; expected a file (text, or a .bin of uint16 tokens)"),
    (["--data", "{tmp}/empty.txt"], "empty.txt: the file is empty"),
    (["--data", "{tmp}/odd.bin"], "odd.bin: a .bin file must hold uint16 tokens (an even number of bytes)"),
    (["--data", "{tmp}/tiny.txt"], "the data has 10 tokens: too few for one window of 17"),
    (["--block-size", "100000"], "too few for one window of 100001"),
    (["--block-size", "1024"], "holds 4 windows of --block-size 1024 tokens, fewer than --global-batch 8"),
    (["--vocab-size", "100"], "--vocab-size 100 is too small for --data (corpus.txt (bytes)): it holds token id 121"),
    (["--data", "{tmp}/tokens.bin", "--vocab-size", "256"], ("--vocab-size 256 is too small for --data "
                                                              "(tokens.bin (uint16 tokens)): it holds token id 399")),
    # the model's shape
    (["--n-head", "3", "--n-embd", "32"], "--n-embd 32 must be a multiple of --n-head 3"),
    (["--n-layer", "-1"], "--n-layer must be at least 1; got -1"),
    (["--n-layer", "0"], "--n-layer must be at least 1; got 0"),
    (["--n-head", "0"], "--n-head must be at least 1; got 0"),
    (["--n-embd", "0"], "--n-embd must be at least 1; got 0"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1); got 1.5"),
    (["--dropout", "-0.1"], "--dropout must be in [0, 1); got -0.1"),
    (["--rebalance-threshold", "-5"], "--rebalance-threshold must not be negative"),
    # numbers that are not numbers
    *[([f"{option}={value}"], f"{option} must be a finite number; got {float(value)}")
      for option, value in NOT_FINITE],
    (["--speeds", "1,nan"], "--speeds '1,nan': every factor must be a number in (0, 1000]"),
    (["--speeds", "inf,1"], "--speeds 'inf,1': every factor must be a number in (0, 1000]"),
    (["--slowdown", "1:3:nan"], "--slowdown '1:3:nan': the step must be >= 0 and the factor a number in (0, 1000]"),
    (["--slowdown", "1:3:inf"], "--slowdown '1:3:inf': the step must be >= 0 and the factor a number in (0, 1000]"),
    # the output directory
    (["--out", "{tmp}/a-file"], "a-file: exists and is not a directory"),
    (["--out", "{tmp}/a-file/run"], "a-file is a file, not a directory"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_bad_train_input_is_one_line_before_any_process(files, arguments, message, capsys):
    assert message in train_refused(files, arguments, capsys)


def not_writable(monkeypatch, directory: Path) -> None:
    """`directory` read-only, as os.access sees it: by its mode, or, where the tests run
    as root (whom modes do not stop), by os.access answering so for it alone."""
    directory.chmod(0o555)
    if os.geteuid() == 0:
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and Path(path) != directory)


def test_an_unwritable_out_is_refused(files, monkeypatch, capsys):
    (files / "locked").mkdir()
    not_writable(monkeypatch, files / "locked")
    try:
        err = train_refused(files, ["--out", "{tmp}/locked/run"], capsys)
    finally:
        (files / "locked").chmod(0o755)
    assert "locked/run: " in err and "locked is not writable" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_where_nothing_can_be_created_is_refused(files, capsys):
    # os.access lets root write into /proc; creating anything there fails (rank 0 failed
    # on it 12 s into the run, after the launcher's checks had passed).
    err = train_refused(files, ["--out", "/proc/hetcomm-run"], capsys)
    assert "--out /proc/hetcomm-run: nothing can be created in /proc" in err


def run_dir(root: Path, records: list) -> Path:
    """A run directory whose steps.jsonl holds these lines (dicts as JSON, str as is)."""
    run = root / "run"
    run.mkdir()
    config = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "global_batch": 8, "wire": "float32"}
    header = {"config": config, "vocab_size": 256, "simulated": True,
              "ranks": [{"device": "cpu", "capability": None, "host": "h", "speed": 1.0}] * 2}
    (run / "run.json").write_text(json.dumps(header))
    (run / "steps.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return run


STEP = {"step": 1, "loss": 5.0, "micro_batch": [4, 4], "samples": [4, 4], "samples_per_second": [10.0, 10.0],
        "compute_s": [0.4, 0.4], "update_s": [0.01, 0.01], "wait_s": [0.05, 0.05]}
NO_LOSS = {k: v for k, v in STEP.items() if k != "loss"}
NO_COMPUTE = {k: v for k, v in STEP.items() if k != "compute_s"}


@pytest.mark.parametrize("records, message", [
    ([STEP, NO_LOSS], "steps.jsonl, line 2: the step's record has no loss"),
    ([STEP, '{"step": 2, "loss": '], "steps.jsonl, line 2: not JSON"),
    ([STEP, "[1, 2]"], "steps.jsonl, line 2: expected a JSON object"),
])
def test_a_bad_log_is_one_line_for_report(tmp_path, records, message, capsys):
    run = run_dir(tmp_path, records)
    with pytest.raises(SystemExit) as stop:
        report.main([str(run)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("hetcomm report: error: ") and message in err
    assert str(run / "steps.jsonl") in err and "Traceback" not in err
    assert not list(run.glob("*.png"))


def test_a_log_of_two_rank_counts_is_one_line_for_report(tmp_path, capsys):
    run = run_dir(tmp_path, [STEP, {**STEP, "step": 2, "micro_batch": [3, 3, 2]}])
    with pytest.raises(SystemExit) as stop:
        report.main([str(run)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "steps.jsonl, record 2: micro_batch = [3, 3, 2]: expected a list of 2 " \
        "values, one per rank" in err and "Traceback" not in err


@pytest.mark.parametrize("loss, summary, warnings", [
    (5.0, '{"steps": 2}', []),
    (float("nan"), '{"steps": 2}', ["the loss is not a finite number at 1 of 2 steps (first at step 2): gaps"]),
    (5.0, None, ["summary.json: none; the run did not finish (or still runs): plotted from its 2 logged steps"]),
    (float("inf"), '{"steps": ', ["the loss is not a finite number at 1 of 2 steps", "summary.json: not readable "
                                  "as JSON (Expecting value: line 1 column 11 (char 10)); plotted from steps.jsonl"]),
])
def test_report_says_what_its_plots_cannot_show(tmp_path, loss, summary, warnings, capsys):
    run = run_dir(tmp_path, [STEP, {**STEP, "step": 2, "loss": loss}])
    if summary is not None:
        (run / "summary.json").write_text(summary)
    assert report.main([str(run)]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == len(warnings) and all(line.startswith("hetcomm report: warning: ") for line in lines)
    for line, warning in zip(lines, warnings):
        assert warning in line, line
    assert captured.out.split() == [str(run / "loss.png"), str(run / "balance.png")]


def test_report_on_an_unwritable_run_is_one_line(tmp_path, monkeypatch, capsys):
    run = run_dir(tmp_path, [STEP])
    not_writable(monkeypatch, run)
    try:
        with pytest.raises(SystemExit) as stop:
            report.main([str(run)])
    finally:
        run.chmod(0o755)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "cannot write the plots there (not writable)" in err
    assert not list(run.glob("*.png"))


@pytest.mark.parametrize("records, message", [
    ([STEP, NO_COMPUTE], "steps.jsonl, line 2: the step's record has no compute_s"),
    ([STEP, '{"step": 2,'], "steps.jsonl, line 2: not JSON"),
])
def test_a_bad_log_is_one_line_for_plan_profile(tmp_path, records, message, capsys):
    run = run_dir(tmp_path, records)
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(["--profile", str(run)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"hetcomm plan: error: --profile {run}: ") and message in err
    assert str(run / "steps.jsonl") in err and "Traceback" not in err


@pytest.mark.parametrize("cap", [float("nan"), float("inf"), 0.0])
def test_reducer_refuses_a_bucket_cap_that_is_no_size(monkeypatch, cap):
    # The check comes before any collective: a group is only needed to get that far.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match=rf"bucket_cap_mb must be a finite positive number; got {cap}"):
        hetcomm.WeightedReducer([torch.nn.Parameter(torch.zeros(3))], bucket_cap_mb=cap)


def test_summary_says_slower_when_balancing_lost():
    assert speedup_words(1.5) == "1.50x faster"
    assert speedup_words(1.0) == "1.00x faster"
    assert speedup_words(0.41) == "2.44x slower"


def fails_on_rank_1(rank, world, device, config):
    """A failure only a rank can meet (such as a token id beyond the vocabulary in a
    window of a file too large to scan at start-up)."""
    if rank == 1:
        raise ValueError("window 3 of the data holds token id 300, but --vocab-size is 256\nsecond line")
    dist.barrier()


def test_a_rank_s_failure_is_one_line_naming_the_rank(files, monkeypatch, capfd):
    """The one test here that starts processes: 2 CPU ranks, once without and once with --debug."""
    real_launch = launch.launch
    monkeypatch.setattr(launch, "launch", lambda _train, *args, **kwargs: real_launch(fails_on_rank_1, *args,
                                                                                      **kwargs))
    arguments = ["--nproc", "2", "--global-batch", "8", *SMALL_MODEL, "--data", str(files / "corpus.txt"),
                 "--out", str(files / "run"), "--no-progress"]
    for debug in (False, True):
        with pytest.raises(SystemExit) as stop:
            launch.main(arguments + ["--debug"] * debug)
        err = capfd.readouterr().err
        assert stop.value.code == 1
        line = "hetcomm train: error: rank 1: ValueError: window 3 of the data holds token id 300, but " \
               "--vocab-size is 256"
        if debug:
            assert "Traceback (most recent call last)" in err and "in fails_on_rank_1" in err
            assert err.endswith(line + "\n")
        else:
            assert err == line + " (--debug prints its traceback)\n"


def test_output_cut_short_by_its_reader_ends_quietly():
    """`hetcomm plan --list-devices | head -1`: the reader closes the pipe early (here at
    once, before the command prints); it stops without a BrokenPipeError traceback, status 0."""
    import subprocess
    import sys
    job = subprocess.Popen([sys.executable, "-m", "hetcomm", "plan", "--list-devices"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    job.stdout.close()
    assert job.wait(timeout=60) == 0
    assert b"Traceback" not in job.stderr.read()
