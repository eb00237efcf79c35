"""The plain launcher (no torchrun) SIGKILLed: every process it started (the fork server,
the resource tracker, the ranks) ends with it, and nothing more is written into the run's
files. Without torchrun's agent, the ranks' parent is the fork server, which lives as long
as its ranks do: a probe once saw them train on for minutes with parent 1."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

# Liveness bounds only, not timings: the host is shared and noisy. Starting a run imports
# torch in three processes; the ranks end a few seconds after the launcher at most.
START_LIMIT_S = 240
END_LIMIT_S = 25
MARK = "HETCOMM_ORPHAN_TEST_RUN"
TEXT = ("def greet(name):\n    return 'hello ' + name\n\nclass Point:\n    x = 0\n    y = 0\n" * 60).encode()
TRAIN = ["--global-batch", "8", "--block-size", "16", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
         "--split", "3,5", "--checkpoint-every", "50", "--no-progress", "--device", "cpu"]

# A program of its own that calls launch(): two ranks that append a line to their file
# every 50 ms for ten minutes.
PROGRAM = textwrap.dedent('''
    import sys
    import time

    from hetcomm.loop.launch import launch


    def tick(rank, world, device, out):
        with open(f"{out}/rank-{rank}.log", "a") as log:
            for _ in range(12000):
                log.write("tick\\n")
                log.flush()
                time.sleep(0.05)


    if __name__ == "__main__":
        launch(tick, sys.argv[1], nproc=2, use_cuda=False)
''')


def processes_of(run: str) -> list[int]:
    """Every live process whose environment carries this run's mark: the launcher and all
    it started, whoever their parent is now. A zombie (ended, not yet reaped) has no
    environment left to read and does not count."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environment = (entry / "environ").read_bytes()
            except OSError:
                continue
            if f"{MARK}={run}".encode() in environment.split(b"\0"):
                found.append(int(entry.name))
    return sorted(found)


def parent_of(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def lines_in(files: list[Path]) -> int:
    return sum(len(f.read_bytes().splitlines()) for f in files if f.is_file())


def start(command: list[str], tmp_path: Path) -> tuple[subprocess.Popen, str]:
    """The command in a session of its own, its environment marked, its output in files
    (a pipe nobody reads would stall the ranks that inherit it)."""
    run = uuid.uuid4().hex
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        job = subprocess.Popen(command, env={**os.environ, MARK: run}, stdout=out, stderr=err,
                               start_new_session=True)
    return job, run


def kill_launcher_and_watch(job: subprocess.Popen, run: str, files: list[Path], tmp_path: Path) -> None:
    """Waits until the run writes into `files`, SIGKILLs the launcher alone, and checks
    that no process of the run is left and the files stop growing."""
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while lines_in(files) == 0:
            assert job.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.monotonic() < deadline, f"nothing written in {START_LIMIT_S} s"
            time.sleep(0.2)
        started = processes_of(run)
        # The launcher, its fork server and resource tracker, and the two ranks: the mark
        # finds them all (else this test could pass by finding nothing).
        assert job.pid in started and len(started) >= 5, started
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        deadline = time.monotonic() + END_LIMIT_S
        while left := processes_of(run):
            assert time.monotonic() < deadline, \
                f"processes {left} (parents {[parent_of(p) for p in left]}) outlived the launcher by {END_LIMIT_S} s"
            time.sleep(0.2)
        written = lines_in(files)
        time.sleep(2)
        assert lines_in(files) == written
    finally:
        for pid in processes_of(run):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the run's processes through /proc")
def test_a_killed_hetcomm_train_takes_its_fork_server_and_ranks_along(tmp_path):
    corpus, out = tmp_path / "corpus.txt", tmp_path / "run"
    corpus.write_bytes(TEXT)
    job, run = start([sys.executable, "-m", "hetcomm", "train", "--nproc", "2", "--steps", "100000", "--data",
                      str(corpus), "--out", str(out), *TRAIN], tmp_path)
    kill_launcher_and_watch(job, run, [out / "steps.jsonl"], tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the run's processes through /proc")
def test_a_killed_program_that_calls_launch_takes_its_ranks_along(tmp_path):
    program, out = tmp_path / "program.py", tmp_path / "ticks"
    program.write_text(PROGRAM)
    out.mkdir()
    job, run = start([sys.executable, str(program), str(out)], tmp_path)
    kill_launcher_and_watch(job, run, [out / "rank-0.log", out / "rank-1.log"], tmp_path)
