"""Two machines joined by `torchrun --nnodes 2`, as two agents on this host (c10d
rendezvous on 127.0.0.1, each agent in a session of its own): `hetcomm train` with and
without --shard, a BalancedLoop script and a BalancedTrainer script train exactly what
one agent with every rank does; a machine lost stops the other's ranks within the
timeout, naming the lost node's ranks, with nothing of the job left; the same command
on both machines then resumes and ends where an uninterrupted run does.

"Exactly" is bit for bit: every rank computes the same samples in the same order with
one thread, and Gloo sums the same ranks' buffers in the same order, whichever machine
a rank is on; nothing of the computation depends on the node (the split is fixed, so
no timing reaches the result; --shard's ranges come from --state-memory, not from the
host's free memory)."""

import hashlib
import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from two_nodes import Job

from hetcomm.loop import checkpoint

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the jobs' processes through /proc")

TESTS = Path(__file__).parent
TEXT = ("def greet(name):\n    return 'hello ' + name\n\nclass Point:\n    x = 0\n    y = 0\n" * 60).encode()
STEPS, TIMEOUT_S = 10, 10
# Two ranks (one per node), a fixed uneven split; slowed to steps of ~0.2 s so that a
# machine can be lost between steps. The same command for the straight and the faulted run.
TRAIN = ["--steps", str(STEPS), "--global-batch", "8", "--block-size", "16", "--n-layer", "1", "--n-head", "2",
         "--n-embd", "32", "--wire", "float32", "--split", "3,5", "--checkpoint-every", "2", "--no-progress",
         "--device", "cpu", "--speeds", "0.03,0.03", "--timeout", str(TIMEOUT_S)]
# Four ranks (two per node), the optimizer state in ranges of 1:2:2:3.
SHARD = ["--steps", "3", "--global-batch", "8", "--block-size", "16", "--n-layer", "1", "--n-head", "2",
         "--n-embd", "32", "--wire", "float32", "--split", "1,2,2,3", "--no-progress", "--device", "cpu", "--shard",
         "--state-memory", "1G,2G,2G,3G"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("two-nodes")
    (path / "corpus.txt").write_bytes(TEXT)
    return path


def train(work: Path, out: Path, nodes: int, nproc: int, settings: list[str], node_args=None) -> Job:
    return Job(work / "logs", ["-m", "hetcomm", "train", "--data", str(work / "corpus.txt"), "--out", str(out),
                               *settings], nodes, nproc, node_args)


def completed(job: Job) -> str:
    """The output of a job that must succeed, and nothing of it left running."""
    try:
        return job.finish()
    finally:
        assert job.kill_leftovers() == [], "processes of a finished job were still running"


def final_state(out: Path) -> dict:
    return torch.load(checkpoint.checkpoints(out)[0], weights_only=True)


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def logged(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def straight(work) -> dict[str, Path]:
    """--out of the 2-rank run uninterrupted: on two agents of one rank, and on one of two."""
    runs = {"two agents": work / "straight-two", "one agent": work / "straight-one"}
    completed(train(work, runs["two agents"], 2, 1, TRAIN))
    completed(train(work, runs["one agent"], 1, 2, TRAIN))
    return runs


def test_two_agents_train_bit_for_bit_as_one_agent_with_every_rank(straight):
    two, one = (final_state(straight[k]) for k in ("two agents", "one agent"))
    assert two["step"] == one["step"] == STEPS
    assert same_tensors(two["model"], one["model"])
    assert two["optimizer"]["state"].keys() == one["optimizer"]["state"].keys()
    assert all(same_tensors(two["optimizer"]["state"][k], one["optimizer"]["state"][k])
               for k in one["optimizer"]["state"])
    losses = [[s["loss"] for s in logged(straight[k])] for k in ("two agents", "one agent")]
    assert losses[0] == losses[1] and len(losses[0]) == STEPS and losses[0][-1] < losses[0][0]
    run = json.loads((straight["two agents"] / "run.json").read_text())
    assert len(run["ranks"]) == 2


def test_two_agents_train_sharded_bit_for_bit_as_one_agent(work):
    outs = {nodes: work / f"shard-{nodes}" for nodes in (2, 1)}
    completed(train(work, outs[2], 2, 2, SHARD))
    completed(train(work, outs[1], 1, 4, SHARD))
    two, one = final_state(outs[2]), final_state(outs[1])
    assert two["step"] == one["step"] == 3 and same_tensors(two["model"], one["model"])
    assert two["shard"]["bounds"] == one["shard"]["bounds"]
    # Each rank's range of the moments and masters, written beside the checkpoint.
    ranges = [sorted(p.name for p in out.iterdir() if ".range-" in p.name) for out in (outs[2], outs[1])]
    assert ranges[0] == ranges[1] and len(ranges[0]) == 4
    for name in ranges[0]:
        saved = [torch.load(out / name, weights_only=True) for out in (outs[2], outs[1])]
        assert same_tensors(saved[0]["tensors"], saved[1]["tensors"]), name
    assert [s["loss"] for s in logged(outs[2])] == [s["loss"] for s in logged(outs[1])]


@pytest.fixture(scope="module")
def scripts(work) -> dict[int, Path]:
    """tests/two_nodes_scripts.py's saved results (a prefix of the files), on two agents
    of one rank and on one agent of two."""
    saved = {}
    for nodes, nproc in ((2, 1), (1, 2)):
        saved[nodes] = work / f"scripts-{nodes}"
        completed(Job(work / "logs", [str(TESTS / "two_nodes_scripts.py"), str(saved[nodes])], nodes, nproc))
    return saved


def test_a_balanced_loop_on_two_agents_ends_as_on_one_agent(scripts):
    two, one = (torch.load(f"{scripts[n]}.loop.pt", weights_only=True) for n in (2, 1))
    assert two["losses"] == one["losses"] and one["losses"][-1] < one["losses"][0]
    assert same_tensors(two["weights"], one["weights"])


def test_a_balanced_trainer_on_two_agents_ends_as_on_one_agent(scripts):
    pytest.importorskip("transformers", minversion="5.0", reason="BalancedTrainer needs pip install 'hetcomm[hf]'")
    pytest.importorskip("accelerate", reason="BalancedTrainer needs pip install 'hetcomm[hf]'")
    two, one = (torch.load(f"{scripts[n]}.trainer.pt", weights_only=True) for n in (2, 1))
    assert same_tensors(two, one)


def gone_within(job: Job, limit: float) -> float:
    """Seconds until no process of the job is left (at most `limit`); the job's
    leftovers are killed when the limit passes, and the test fails."""
    start = time.monotonic()
    while job.processes():
        if time.monotonic() - start > limit:
            left = job.kill_leftovers()
            raise AssertionError(f"processes {left} of the job lived {limit} s after the node was lost:\n"
                                 f"{job.output()}")
        time.sleep(0.1)
    job.wait(30)
    return time.monotonic() - start


def lose_node(work: Path, out: Path, node: int, workers: bool) -> Job:
    """The 2-rank run on two agents, `node` killed after 3 logged steps (its agent's
    process group; with `workers`, its workers too: the machine lost)."""
    job = train(work, out, 2, 1, TRAIN)
    try:
        deadline = time.monotonic() + 300   # a guard against a hung job, not a timing check
        while len(logged(out)) < 3:
            assert all(agent.poll() is None for agent in job.agents), job.output()
            assert time.monotonic() < deadline, f"no 3 steps logged in 300 s:\n{job.output()}"
            time.sleep(0.1)
        job.kill_node(node, workers=workers)
        # The liveness bound the issue sets: the timeout, plus 3 s to end.
        gone_within(job, TIMEOUT_S + 3)
    finally:
        job.kill_leftovers()
    return job


@pytest.fixture(scope="module")
def machine_lost(work) -> tuple[Path, Job, Path]:
    """--out of the run whose node 1 was lost, its job, and a copy of that --out taken
    before anything resumed there."""
    out = work / "machine-lost"
    job = lose_node(work, out, 1, workers=True)
    shutil.copytree(out, work / "machine-lost-copy")
    return out, job, work / "machine-lost-copy"


def test_a_lost_machine_stops_the_other_within_the_timeout_naming_its_ranks(machine_lost):
    out, job, _ = machine_lost
    assert job.agents[0].returncode == 1 and job.agents[1].returncode == -signal.SIGKILL
    survivors = job.output(0)
    named = [line for line in survivors.splitlines() if line.startswith("hetcomm train: error: rank ")]
    assert named, survivors
    assert all("Not answering after it: node 1 (rank 1)." in line for line in named), named
    assert 3 <= len(logged(out)) < STEPS


def test_a_lost_rendezvous_host_is_said_by_the_other_machine(work):
    """Node 0's machine serves the job's store: lost with it, the ranks cannot be told."""
    job = lose_node(work, work / "host-lost", 0, workers=True)
    assert job.agents[0].returncode == -signal.SIGKILL and job.agents[1].returncode == 1, job.output()
    named = [line for line in job.output(1).splitlines() if line.startswith("hetcomm train: error: rank ")]
    assert named and all("Not answering after it: the job's store (the rendezvous endpoint's node)." in line
                         for line in named), named


def test_a_killed_agent_stops_every_rank_within_the_timeout_naming_its_node(work):
    """Its agent's process group SIGKILLed, node 1's workers live on: the parent-death
    SIGTERM stops every rank after one step with a checkpoint, and the job fails by name
    (without it, node 0's agent waited for the dead one at its exit barrier for 300 s)."""
    out = work / "agent-killed"
    job = lose_node(work, out, 1, workers=False)
    assert job.agents[0].returncode == 1, job.output()
    named = [line for line in job.output().splitlines() if line.startswith("hetcomm train: error: rank ")]
    assert {line.split(":")[2].strip() for line in named} == {"rank 0", "rank 1"}, named
    assert all("LauncherLost: node 1 (rank 1) lost the launcher" in line for line in named), named
    stopped = final_state(out)["step"]
    assert 3 <= stopped < STEPS and f"stopped after step {stopped} with a checkpoint" in named[0]


def test_the_same_command_on_both_machines_resumes_and_ends_as_the_straight_run(work, machine_lost, straight):
    out, _, _ = machine_lost
    resumed_from = final_state(out)["step"]
    err = completed(train(work, out, 2, 1, TRAIN))
    assert f"resuming from {out / f'checkpoint-{resumed_from:08d}.pt'} (step {resumed_from} of {STEPS})" in err
    assert [s["step"] for s in logged(out)] == list(range(STEPS))   # the lost steps' lines cut back
    expected = final_state(straight["two agents"])
    assert same_tensors(final_state(out)["model"], expected["model"])
    assert [s["loss"] for s in logged(out)] == [s["loss"] for s in logged(straight["two agents"])]


def digest_of(directory: Path) -> dict:
    """Every file's SHA-256 but the lock's, which names the run that holds --out now."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name != ".hetcomm-train.lock"}


def test_a_restart_whose_nodes_see_different_checkpoints_is_refused_by_name(work, machine_lost):
    """Each node resumes from its own --out: where the machines do not share it, node 1
    found none and would have started over beside node 0's resumed rank."""
    kept = work / "not-shared" / "node0"
    shutil.copytree(machine_lost[2], kept)
    before = digest_of(kept)
    job = train(work, kept, 2, 1, TRAIN, node_args=[[], ["--out", str(work / "not-shared" / "node1")]])
    try:
        assert job.wait() == [1, 1], job.output()
    finally:
        job.kill_leftovers()
    step = final_state(kept)["step"]
    named = [line for line in job.output().splitlines() if line.startswith("hetcomm train: error: rank ")]
    assert len(named) == 2 and all(f"the ranks start at different steps (node 1 (rank 1) at step 0; node 0 (rank 0) "
                                   f"at step {step})" in line for line in named), named
    assert "a shared filesystem" in named[0]
    assert digest_of(kept) == before
