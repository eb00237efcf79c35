"""Faults a cluster of old cards meets, injected: a worker killed (twice) under torchrun,
preemption by SIGTERM, damaged and foreign checkpoints, a stalled rank. The job goes on
where it stopped and ends as an uninterrupted run would, bit for bit (a fixed split), or
stops with one line that names the cause, leaving --out as it was."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed import run_ranks, values

from hetcomm.loop import checkpoint
from hetcomm.loop.launch import free_port
from hetcomm.train import launch
from hetcomm.train.config import from_args, parser
from hetcomm.train.out_lock import hold_out
from hetcomm.train.trainer import Trainer

TEXT = ("def greet(name):\n    return 'hello ' + name\n\nclass Point:\n    x = 0\n    y = 0\n" * 60).encode()
# A fixed split: the same samples in the same sums whatever happens, so runs compare bit for bit.
TRAIN = ["--global-batch", "8", "--block-size", "16", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
         "--wire", "float32", "--split", "3,5", "--checkpoint-every", "2", "--no-progress", "--device", "cpu"]


def corpus(tmp_path: Path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_bytes(TEXT)
    return str(path)


def torchrun(tmp_path: Path, out: Path, steps: int, *extra: str) -> subprocess.Popen:
    """`hetcomm train` on 2 CPU ranks under torchrun, restarting failed workers twice.
    Slowed to a step of about 0.2 s so that faults can be injected between steps."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "hetcomm", "train",
               "--steps", str(steps), "--data", corpus(tmp_path), "--out", str(out), "--speeds", "0.03,0.03",
               *TRAIN, *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def logged_steps(out: Path) -> list[int]:
    path = out / "steps.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


# Only a guard against a hung job, not a timing check: on a loaded 2-core machine a guard of
# 120 s failed the killed-twice test once (each restart imports torch in two workers again).
def wait_for_steps(out: Path, count: int, job: subprocess.Popen, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while len(logged_steps(out)) < count:
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {count} steps logged in {limit} s"
        time.sleep(0.2)


def workers(agent: int) -> list[int]:
    """The worker processes torchrun's agent started (its children), by /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == agent:
                found.append(int(entry.name))
    return sorted(found)


def running(pid: int) -> bool:
    """Whether the process lives: a zombie (exited, not yet reaped by whoever adopted it)
    does not."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def final_weights(out: Path) -> dict:
    return torch.load(checkpoint.checkpoints(out)[0], weights_only=True)["model"]


def finish(job: subprocess.Popen) -> str:
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    return err


STEPS = 24   # of the torchrun jobs that faults interrupt


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The final weights of the torchrun job of STEPS steps run through uninterrupted:
    where every interrupted one must end."""
    tmp_path = tmp_path_factory.mktemp("straight")
    finish(torchrun(tmp_path, tmp_path / "out", STEPS))
    return final_weights(tmp_path / "out")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
def test_a_torchrun_job_with_a_worker_killed_twice_ends_as_an_uninterrupted_run(tmp_path, straight):
    out = tmp_path / "killed"
    job = torchrun(tmp_path, out, STEPS)
    for kill in (1, 2):
        wait_for_steps(out, 7 * kill, job)
        os.kill(workers(job.pid)[-1], signal.SIGKILL)
        time.sleep(1)   # torchrun restarts the workers; the log is cut back to the checkpoint
    err = finish(job)
    assert err.count("hetcomm train: resuming from") == 2 and "Traceback" not in err
    assert logged_steps(out) == list(range(STEPS))   # every step once: the killed runs' later lines cut
    assert all(torch.equal(t, straight[name]) for name, t in final_weights(out).items())


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
def test_a_killed_torchrun_agent_takes_its_workers_along_and_holds_out_till_then(tmp_path, capsys):
    out = tmp_path / "run"
    job = torchrun(tmp_path, out, 400)
    wait_for_steps(out, 3, job)
    ranks = workers(job.pid)
    assert len(ranks) == 2
    # While it runs, a second run into its --out is refused, naming the holder.
    with pytest.raises(SystemExit) as stop:
        launch.main(["--nproc", "2", "--steps", "400", "--data", corpus(tmp_path), "--out", str(out),
                     "--speeds", "0.03,0.03", *TRAIN])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"--out {out} is in use by a live run (PID " in err, err
    assert any(f"(PID {pid} on " in err for pid in ranks), (err, ranks)   # rank 0's worker holds it
    job.kill()   # SIGKILL to torchrun's agent alone: its workers were orphaned and trained on
    job.communicate()
    deadline = time.monotonic() + 60
    while any(running(pid) for pid in ranks):
        assert time.monotonic() < deadline, "the workers outlived their agent by a minute"
        time.sleep(0.2)
    logged = logged_steps(out)
    time.sleep(1)
    assert logged_steps(out) == logged and len(logged) < 400
    with hold_out(str(out)):   # free again
        pass


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers through /proc")
def test_sigterm_stops_every_rank_after_one_step_and_the_same_command_resumes(tmp_path, straight):
    out = tmp_path / "preempted"
    job = torchrun(tmp_path, out, STEPS)
    wait_for_steps(out, 4, job)
    for worker in workers(job.pid):   # a scheduler preempting the job signals every process
        os.kill(worker, signal.SIGTERM)
    finish(job)
    stopped = checkpoint.checkpoints(out)[0]
    step = torch.load(stopped, weights_only=True)["step"]
    assert 4 <= step < STEPS   # the step every rank agreed to stop after
    assert not (out / "summary.json").exists()
    err = finish(torchrun(tmp_path, out, STEPS))
    assert f"resuming from {stopped}" in err
    assert logged_steps(out) == list(range(STEPS))
    assert all(torch.equal(t, straight[name]) for name, t in final_weights(out).items())


def unfinished_run(rank, world, config):
    """Four steps of a six-step run, checkpointed every two, then a crash."""
    trainer = Trainer(config, rank, world, torch.device("cpu"))
    trainer.run(until=4)
    return None


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    """--out of a run that crashed after step 4 of 6 (checkpoints at 2 and 4), and its
    command line."""
    tmp_path = tmp_path_factory.mktemp("crashed")
    out = tmp_path / "out"
    arguments = ["--nproc", "2", "--steps", "6", "--data", corpus(tmp_path), "--out", str(out), *TRAIN]
    config = from_args(parser().parse_args(arguments))
    values(run_ranks(2, unfinished_run, config, tmp_path=tmp_path))
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-00000004.pt", "checkpoint-00000002.pt"]
    return out, arguments


def digest_of(directory: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
    path.write_bytes(bytes(data))


def resaved(path: Path, change=lambda state: None, step: int | None = None) -> None:
    """The checkpoint re-written by someone who recomputed its digests after `change`
    (at another step when given)."""
    state = torch.load(path, weights_only=True)
    state.pop("format"), state.pop("digests")
    written = state.pop("step")
    change(state)
    path.unlink()
    checkpoint.save(path.parent, written if step is None else step, state, keep=10)


DAMAGE = {
    "4 KB of flipped bytes": flip_bytes,
    "an empty file": lambda p: p.write_bytes(b""),
    "a truncated file": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 3]),
    "a tensor edited and saved again": lambda p: edited(p),
    "a value that is not a tensor edited and saved again": lambda p: edited_value(p),
}


def edited(path: Path) -> None:
    """Loaded, one weight changed, saved with torch.save: a well-formed file (its zip
    records' CRCs right) whose digests no longer hold."""
    state = torch.load(path, weights_only=True)
    state["model"]["wte.weight"][0, 0] += 1
    torch.save(state, path)


def edited_value(path: Path) -> None:
    """The same with the loop's step moved on by one: a change that no tensor digest
    covers, after which a resumed run would deal its samples from the wrong step."""
    state = torch.load(path, weights_only=True)
    state["loop"]["step"] += 1
    torch.save(state, path)


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_is_passed_over_for_the_one_before(crashed_run, tmp_path, damage, capsys):
    out, arguments = crashed_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    DAMAGE[damage](copy / "checkpoint-00000004.pt")
    config = from_args(parser().parse_args([*arguments[:-len(TRAIN) - 2], "--out", str(copy), *TRAIN]))
    launch._check_resume(config, 2)
    assert config.resume == str(copy / "checkpoint-00000002.pt")
    assert "passing over" in capsys.readouterr().err


def test_only_damaged_checkpoints_stop_with_one_line_and_touch_nothing(crashed_run, tmp_path, capsys):
    out, arguments = crashed_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    for path in checkpoint.checkpoints(copy):
        flip_bytes(path)
    before = digest_of(copy)
    with pytest.raises(SystemExit) as stop:
        launch.main([*arguments[:-len(TRAIN) - 2], "--out", str(copy), *TRAIN])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "holds checkpoints of no resumable run" in err and "--fresh" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert digest_of(copy) == before


DATA_CHANGES = {
    "regenerated: the same size, other content": lambda text: text.replace(b"greet", b"gReet"),
    "cut by a few bytes: the same window count": lambda text: text[:-((len(text) - 1) % 16)],
}


@pytest.mark.parametrize("change", DATA_CHANGES)
def test_a_resume_on_changed_data_is_refused_naming_the_file(crashed_run, tmp_path, change, capsys):
    out, _ = crashed_run
    copy, data = tmp_path / "out", tmp_path / "corpus.txt"
    shutil.copytree(out, copy)
    changed = DATA_CHANGES[change](TEXT)
    assert changed != TEXT and (len(changed) - 1) // 16 == (len(TEXT) - 1) // 16   # the window count cannot tell
    data.write_bytes(changed)
    base = ["--nproc", "2", "--steps", "6", "--data", str(data), "--out", str(copy), *TRAIN]
    before = digest_of(copy)
    for resume in ([], ["--resume", str(copy / "checkpoint-00000002.pt")]):
        with pytest.raises(SystemExit) as stop:
            launch.main([*base, *resume])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"--data {data}: its content is not what" in err, err
        assert "--data-changed" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert digest_of(copy) == before
    config = from_args(parser().parse_args([*base, "--data-changed"]))   # changed on purpose
    launch._check_resume(config, 2)
    assert config.resume == str(copy / "checkpoint-00000004.pt")


BAD_RESUMES = {
    "NaN weights": (lambda s: s["model"]["wte.weight"].fill_(float("nan")), "holds inf or NaN values"),
    "no optimizer": (lambda s: s.pop("optimizer"), "holds no optimizer state"),
    "a wrong shape": (lambda s: s["model"].update({"wte.weight": torch.zeros(3, 32)}),
                      "model tensor wte.weight is (3, 32), this run's (256, 32)"),
    "another run's": (lambda s: s["run"].update(global_batch=16), "global_batch: checkpoint has 16, this run 8"),
}


@pytest.mark.parametrize("case", BAD_RESUMES)
def test_a_well_formed_but_wrong_checkpoint_is_one_line_before_any_worker(crashed_run, tmp_path, case, capsys):
    out, arguments = crashed_run
    path = tmp_path / "bad" / "checkpoint-00000004.pt"
    path.parent.mkdir()
    shutil.copy(out / "checkpoint-00000004.pt", path)
    change, message = BAD_RESUMES[case]
    resaved(path, change)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        launch.main([*arguments[:-len(TRAIN) - 2], "--out", str(run_dir), *TRAIN, "--resume", str(path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and "Traceback" not in err
    assert not run_dir.exists()


def test_a_checkpoint_at_a_negative_step_is_refused(crashed_run, tmp_path):
    path = tmp_path / "checkpoint-00000004.pt"
    shutil.copy(crashed_run[0] / path.name, path)
    state = torch.load(path, weights_only=True)
    state["step"] = -5
    state["digests"] = checkpoint.digests({k: v for k, v in state.items() if k not in ("format", "digests")})
    torch.save(state, path)   # with its digests recomputed: they hold
    with pytest.raises(checkpoint.CheckpointError, match="step -5 is not a non-negative integer"):
        checkpoint.load(path, {})


@pytest.mark.parametrize("edit", [
    lambda s: s["loop"]["sampler"].update(position=6),   # the next sample dealt
    lambda s: s["loop"].update(scale=1.0),               # a float's last bits
    lambda s: s["loop"].update(overflowed=1),            # a bool read back as an int
    lambda s: s["loop"].update(split=(3, 5)),            # a list read back as a tuple
    lambda s: s.update(step=3),                          # the step
], ids=["sampler position", "float scale", "bool as int", "list as tuple", "step"])
def test_a_value_that_is_not_a_tensor_edited_is_refused_when_read(tmp_path, edit):
    state = {"run": {"seed": 0}, "model": {"w": torch.ones(3)},
             "loop": {"sampler": {"position": 5}, "scale": 1.0 + 2**-52, "overflowed": True, "split": [3, 5]}}
    path = checkpoint.save(tmp_path, 4, state)
    assert checkpoint.load(path, {"seed": 0})["loop"] == state["loop"]
    saved = torch.load(path, weights_only=True)
    edit(saved)
    torch.save(saved, path)
    with pytest.raises(checkpoint.CheckpointError, match="values that are not tensors .* do not hold what was"):
        checkpoint.load(path, {"seed": 0})


def test_a_checkpoint_of_the_previous_format_is_read_with_its_tensors_verified(tmp_path):
    """Format 3 (the previous release) has digests of the tensors only: a run it wrote resumes,
    and a damaged tensor in it is still found."""
    state = {"run": {"seed": 0}, "model": {"w": torch.arange(3.0)}, "loop": {"scale": 8.0}}
    path = checkpoint.save(tmp_path, 4, state)
    previous = torch.load(path, weights_only=True)
    previous["format"] = 3
    previous["digests"] = {name: digest for name, digest in previous["digests"].items()
                           if name != checkpoint.NON_TENSORS}
    torch.save(previous, path)
    loaded = checkpoint.load(path, {"seed": 0})
    assert loaded["step"] == 4 and loaded["loop"] == {"scale": 8.0} and torch.equal(loaded["model"]["w"],
                                                                                      torch.arange(3.0))
    previous["model"]["w"][1] = 5.0
    torch.save(previous, path)
    with pytest.raises(checkpoint.CheckpointError, match="tensor model/w does not hold what was written"):
        checkpoint.load(path, {"seed": 0})


def test_a_rerun_resumes_cuts_the_log_and_removes_stale_temporaries(crashed_run, tmp_path, capsys):
    out, arguments = crashed_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    # The crash came after two more steps were logged, and during a checkpoint's write.
    lines = (copy / "steps.jsonl").read_text().splitlines()
    extra = [json.dumps({**json.loads(lines[-1]), "step": step}) for step in (4, 5)]
    (copy / "steps.jsonl").write_text("\n".join(lines + extra) + "\n{\"step\": 6, \"lo")
    (copy / ".checkpoint-abc123.tmp").write_bytes(b"half a checkpoint")
    assert launch.main([*arguments[:-len(TRAIN) - 2], "--out", str(copy), *TRAIN]) == 0
    assert logged_steps(copy) == list(range(6))
    assert not list(copy.glob(".checkpoint-*.tmp"))
    # The summary times the whole run from its log, and says what this session ran.
    logged_s = sum(json.loads(line)["step_s"] for line in (copy / "steps.jsonl").read_text().splitlines())
    assert f": 6 steps in {logged_s:.3g} s of logged steps (resumed at step 4: " in capsys.readouterr().out


def test_a_stalled_rank_is_reported_within_the_timeout(tmp_path, capsys):
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        launch.main(["--nproc", "2", "--steps", "4", "--data", corpus(tmp_path), "--out", str(tmp_path / "run"),
                     *TRAIN, "--timeout", "4", "--slowdown", "1:1:0.0001"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "not every rank answered within 4 s" in err and "Traceback" not in err
    assert "error: rank 1: stopped answering (it stalled or died); rank 0 saw: CollectiveTimeout" in err, err
    assert time.monotonic() - start < 30   # 4 s, not 4 + the 30 s torch waits for a SIGTERM


def grandchildren(pid: int) -> list[int]:
    """The children of `pid`'s children: under the launcher, the ranks its fork server forked."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    return sorted(p for p, parent in parents.items() if parents.get(parent) == pid)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_a_rank_killed_is_the_rank_named_not_the_peer_that_lost_it(tmp_path):
    out = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "hetcomm", "train", "--nproc", "2", "--steps", "400", "--data",
                            corpus(tmp_path), "--out", str(out), "--speeds", "0.03,0.03", *TRAIN],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(out, 2, job)
    ranks = grandchildren(job.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 1 and re.search(r"error: rank [01]: killed by signal SIGKILL", err), err
    assert "CollectiveTimeout" not in err and "Traceback" not in err and "GLHF" not in err


def test_a_finished_run_is_started_over_and_other_settings_are_refused(crashed_run, tmp_path, capsys):
    out, arguments = crashed_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    base = [*arguments[:-len(TRAIN) - 2], "--out", str(copy), *TRAIN]
    with pytest.raises(SystemExit):
        launch.main([*base, "--seed", "1"])
    err = capsys.readouterr().err
    assert "seed: checkpoint has 0, this run 1" in err and "--fresh" in err
    fresh = from_args(parser().parse_args([*base, "--seed", "1", "--fresh"]))
    launch._check_resume(fresh, 2)
    assert fresh.resume is None
    resaved(copy / "checkpoint-00000004.pt", step=6)   # as if the run there had finished
    config = from_args(parser().parse_args(base))
    launch._check_resume(config, 2)
    assert config.resume is None   # nothing to resume: the same command starts it over


def test_a_log_with_a_step_twice_is_refused_by_report_and_plan(crashed_run, tmp_path, capsys):
    from hetcomm.plan.cli import main as plan
    from hetcomm.train.report import main as report

    copy = tmp_path / "out"
    shutil.copytree(crashed_run[0], copy)
    lines = (copy / "steps.jsonl").read_text().splitlines()
    (copy / "steps.jsonl").write_text("\n".join(lines + lines[-2:]) + "\n")   # appended to without cutting back
    for command in (lambda: report([str(copy)]), lambda: plan(["--profile", str(copy)])):
        with pytest.raises(SystemExit) as stop:
            command()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "step 2 follows step 3; each step must be logged once" in err
