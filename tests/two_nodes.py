"""Two torchrun agents on this host, as two machines joined by `torchrun --nnodes 2`
start them (c10d rendezvous on 127.0.0.1), or one agent with every rank: the
reference. Every process of a job carries a tag of its own in its environment, so
that a test finds them all (the agents, their workers, anything those start) through
/proc, whoever their parent is now, and kills what is left when it ends."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from hetcomm.loop.launch import free_port

TAG = "HETCOMM_TEST_JOB"


def tagged(tag: str) -> list[int]:
    """The live processes whose environment holds TAG=tag (zombies hold none)."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return sorted(found)


class Job:
    """`nodes` torchrun agents (each in a session of its own, as on its own machine)
    running `program` (a script and its arguments, or "-m", a module and its) with
    `nproc` ranks each, node n's program given node_args[n] after its own arguments;
    with nodes=1, one standalone agent. Each agent's stdout and stderr go to a file in
    `logs`."""

    def __init__(self, logs: Path, program: list[str], nodes: int, nproc: int,
                 node_args: list[list[str]] | None = None):
        self.tag = uuid.uuid4().hex
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"agent{n}-{self.tag[:8]}.log" for n in range(nodes)]
        port = free_port()
        if nodes == 1:
            where = ["--standalone"]
        else:
            # A rendezvous id of its own: jobs of parallel tests never join each other.
            where = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--rdzv-id", self.tag]
        command = [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(nproc),
                   *program]
        # One thread per rank, as torchrun sets for several ranks per node but not for one:
        # accelerate then gave a node's lone rank every core, and its matmuls summed in
        # another blocking (results 1 ulp apart from one agent's).
        env = {**os.environ, TAG: self.tag, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.agents = []
        for node, log in enumerate(self.logs):
            with open(log, "w") as sink:
                mine = command + (node_args[node] if node_args else [])
                self.agents.append(subprocess.Popen(mine, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                                    start_new_session=True))
            if nodes > 1 and len(self.agents) == 1:
                self._wait_for_store(port)

    def _wait_for_store(self, port: int, limit: float = 120) -> None:
        """Until node 0's agent serves the rendezvous store: with every agent on
        127.0.0.1, whichever binds the endpoint first hosts it, and node 0's machine is
        the one a lab names as the endpoint."""
        deadline = time.monotonic() + limit
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                assert self.agents[0].poll() is None, f"node 0's agent ended:\n{self.output(0)}"
                assert time.monotonic() < deadline, f"node 0's agent served no store within {limit} s"
                time.sleep(0.1)

    def wait(self, limit: float = 300) -> list[int]:
        """Every agent's exit code, once all have ended (within `limit` s: a guard
        against a hung job, not a timing check)."""
        deadline = time.monotonic() + limit
        codes = []
        for agent in self.agents:
            try:
                codes.append(agent.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not end within {limit} s:\n{self.output()}") from None
        return codes

    def finish(self, limit: float = 300) -> str:
        """Waits for a job that must succeed; its output."""
        codes = self.wait(limit)
        assert codes == [0] * len(codes), f"agents ended with {codes}:\n{self.output()}"
        return self.output()

    def output(self, node: int | None = None) -> str:
        logs = self.logs if node is None else [self.logs[node]]
        return "\n".join(log.read_text(errors="replace") for log in logs)

    def processes(self) -> list[int]:
        return tagged(self.tag)

    def workers(self, node: int) -> list[int]:
        """The processes that node's agent started (its children), by /proc."""
        agent, found = self.agents[node].pid, []
        for pid in self.processes():
            try:
                if int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent:
                    found.append(pid)
            except OSError:
                continue
        return found

    def kill_node(self, node: int, workers: bool) -> None:
        """SIGKILL to the process group of that node's agent; with `workers`, to its
        workers too (each in a session of its own), as when the machine is lost."""
        doomed = self.workers(node) if workers else []
        os.killpg(self.agents[node].pid, signal.SIGKILL)
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)

    def kill_leftovers(self) -> list[int]:
        """SIGKILLs every process of the job still alive; returns their PIDs."""
        left = self.processes()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for agent in self.agents:
            if agent.poll() is None:
                agent.wait(timeout=30)
        return left
