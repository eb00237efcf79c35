"""Starting the ranks of a training function: joining a torchrun job, or starting one
process per local GPU, or a cluster of CPU workers on a machine without GPUs."""

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetcomm.loop import census
from hetcomm.loop.host_memory import keep_freed_memory

DEFAULT_CPU_RANKS = 4
PR_SET_PDEATHSIG = 1   # <linux/prctl.h>
# Once a rank has failed, how long the others get to end on their own, and then to
# answer SIGTERM, before SIGKILL. torch's own wait for SIGTERM is 30 s: a rank that
# stalled (or that the trainer's SIGTERM handler keeps until its step ends, which a
# stalled step never does) delayed the report of the failure by that long.
STOP_GRACE_S = 3.0
# Once the launcher is gone, how long a rank it started gets to end on the SIGTERM it
# sends itself (the trainer finishes its step and checkpoints it) before SIGKILL: a rank
# that ignores SIGTERM, or whose main thread is stuck, must not train on as an orphan.
ORPHAN_GRACE_S = 30.0


class RankFailed(RuntimeError):
    """A rank of the job failed: `rank` and the `cause` in one line, such as
    "ValueError: ..." or "killed by signal SIGKILL"; `trace`, the traceback the rank
    sent when launched with debug (else "")."""

    def __init__(self, rank: int, cause: str, trace: str = ""):
        super().__init__(f"rank {rank}: {cause}")
        self.rank, self.cause, self.trace = rank, cause, trace


def _one_line(error: BaseException) -> str:
    """The exception as "Type: first line of its message"."""
    lines = str(error).strip().splitlines()
    return type(error).__name__ + (f": {lines[0]}" if lines else "")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a local process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_world(use_cuda: bool, nproc: int | None = None) -> int:
    """The ranks of the job: torchrun's, or nproc, or one per GPU, or DEFAULT_CPU_RANKS."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if nproc is not None:
        return nproc
    return torch.cuda.device_count() if use_cuda else DEFAULT_CPU_RANKS


def _rank_main(rank: int, world: int, main: Callable, args: tuple, use_cuda: bool, init_method: str | None,
               timeout: timedelta, debug: bool, failures=None, lifeline=None) -> None:
    """Runs one rank. A failure becomes a RankFailed (under torchrun), or, in a worker
    this process spawned, a one-line cause put on `failures` for the parent and exit
    code 1: torch's own spawn would hand the parent the whole traceback instead.
    With `debug`, the traceback goes with it, for the parent to print: this process's
    stderr is the fork server's, which need not be the parent's now. `lifeline`: the
    read end of the launcher's pipe (see _end_with_launcher), in a worker it spawned."""
    try:
        if lifeline is not None:
            _end_with_launcher(lifeline)
        _run_rank(rank, world, main, args, use_cuda, init_method, timeout)
    except Exception as error:
        if failures is None:
            if debug:
                traceback.print_exc()
            raise RankFailed(rank, _one_line(error) + _not_answering(error)) from error
        failures.put((rank, _one_line(error), traceback.format_exc() if debug else ""))
        sys.stderr.flush()
        # As after a success: leave without the process-group destructors (see _run_rank).
        os._exit(1)


def _join_torchrun_job(backend: str, timeout: timedelta) -> None:
    """init_process_group for a torchrun worker, its keys in the job's store under a
    prefix of this restart's own: torchrun keeps its store across the restarts of a job,
    and a restarted generation that read the process groups' addresses of the killed one
    (the same keys: the same group names) failed to connect ("Gloo connectFullMesh ...
    Connection refused")."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # With the agent's store (torchrun's default) the agent serves it; else rank 0 does.
    serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true" and rank == 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=serves,
                          timeout=timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"hetcomm/restart-{restart}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    census.enrol(store, rank, world, os.environ.get("GROUP_RANK"))


def _not_answering(error: Exception) -> str:
    """Under torchrun, after a collective failed: the ranks that no longer answer (a
    node lost), which the failure itself does not name."""
    if not census.looks_like_a_lost_peer(error):
        return ""
    silent = census.unanswered()
    return f" Not answering after it: {silent}." if silent else ""


def _end_with_parent() -> None:
    """Linux: has this rank sent SIGTERM when the process that started it dies (torchrun's
    agent, or the launcher's fork server). Without it, a killed agent left its workers
    training as orphans, writing into --out beside the workers of a relaunch. SIGTERM,
    not SIGKILL: the trainer's handler then stops every rank after the same step, with a
    checkpoint; a plain program just ends."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return   # not allowed here (a sandbox): the rank lives as before
    if os.getppid() != parent:   # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _end_with_launcher(lifeline) -> None:
    """Has this rank, started by launch() in this machine's launcher, stop when that
    launcher dies, however it dies (SIGKILL included): SIGTERM, as under torchrun (see
    _end_with_parent), then SIGKILL after ORPHAN_GRACE_S if the rank is still there.

    Why a pipe, and not the parent-death signal alone: a rank's parent is the fork
    server, not the launcher, and the fork server lives while any of its children does
    (every child holds the write end of the server's "alive" pipe), so a SIGKILLed
    launcher left the server and its ranks training on as orphans. Only the launcher
    holds the write end of `lifeline` (the fork server was exec'd without it, a rank gets
    the read end only), so the kernel ends the pipe (EOF) exactly when the launcher is
    gone: no polling, no pid that may be reused, no race with a launcher that died
    before this rank looked (the EOF stays), on any POSIX system, not Linux only. The
    launcher never writes into it. The fork server then ends by itself once its last
    rank has, and the resource tracker once the ranks, which hold its pipe, have."""
    def watch() -> None:
        lifeline.poll(None)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="hetcomm-launcher-lifeline", daemon=True).start()


def _run_rank(rank: int, world: int, main: Callable, args: tuple, use_cuda: bool, init_method: str | None,
              timeout: timedelta) -> None:
    _end_with_parent()
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        # The workers share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        keep_freed_memory()
    spawned = init_method is not None
    kwargs = {"init_method": init_method, "rank": rank, "world_size": world} if spawned else {}
    if spawned:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, **kwargs)
    else:
        _join_torchrun_job("nccl" if use_cuda else "gloo", timeout)
    main(dist.get_rank(), dist.get_world_size(), device, *args)
    dist.barrier()
    if spawned:
        # A worker we started has nothing left to do once every rank is past the barrier.
        # Tearing the Gloo group down as the peers exit can abort in torch's C++ destructors
        # (seen with torch 2.13: "terminate called without an active exception"), so the
        # worker leaves without running them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def launch(main: Callable, *args, nproc: int | None = None, use_cuda: bool | None = None,
           timeout: timedelta = timedelta(minutes=10), debug: bool = False) -> None:
    """Runs main(rank, world, device, *args) on every rank of the job: this process's
    rank when torchrun started it (env://), else `nproc` local processes (default one per
    GPU, or DEFAULT_CPU_RANKS CPU workers on Gloo) that this call starts and waits for.
    `main` and `args` must be picklable (a module-level function) for the local processes.

    Raises RankFailed naming the first rank that failed and its exception in one line
    (the other local processes are stopped); `debug` also prints that rank's traceback
    to this process's stderr."""
    use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    world = local_world(use_cuda, nproc)
    if world < 1:
        raise ValueError(f"nproc must be at least 1; got {world}")
    if under_torchrun():
        rank = int(os.environ["LOCAL_RANK"]) if use_cuda else int(os.environ["RANK"])
        _rank_main(rank, world, main, args, use_cuda, None, timeout, debug)
        return
    # The ranks are forked from a server process that has imported torch once, rather than
    # spawned to import it each: 4 CPU workers start in ~2 s instead of ~4 s on 2 cores.
    # The server imports and initialises nothing else (no CUDA), so forking it is safe.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "hetcomm.loop"])
    failures = context.SimpleQueue()
    lifeline, held = context.Pipe(duplex=False)   # see _end_with_launcher
    try:
        with _quiet_spawn_log():
            ranks = mp.start_processes(_rank_main, args=(world, main, args, use_cuda,
                                                         f"tcp://127.0.0.1:{free_port()}", timeout, debug, failures,
                                                         lifeline),
                                       nprocs=world, join=False, start_method="forkserver")
            while not ranks.join(grace_period=STOP_GRACE_S):
                pass
    except mp.ProcessExitedException as exited:
        failure = _first_failure(failures, exited, ranks.processes)
        sys.stderr.write(failure.trace)
        raise failure from None
    finally:
        failures.close()
        # Ranks still there (the launcher's wait interrupted: Ctrl-C) stop as if it died.
        held.close()
        lifeline.close()


@contextmanager
def _quiet_spawn_log() -> Iterator[None]:
    """Without torch's warning for each rank it stops after one failed ("Terminating
    process ... via signal SIGTERM"): stopping them is expected, and the failure that
    caused it is what launch reports."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_failure(failures, exited: mp.ProcessExitedException, processes) -> RankFailed:
    """The failure that came first. A rank killed from outside (a signal: the launcher
    sends none before a failure) queued nothing: it is named. Otherwise the first rank
    that queued its error: a rank whose peer failed fails after it (its collectives lose
    their connection). But when that error is a peer's timeout, a rank the launcher then
    had to stop (it had not ended by itself: stalled) is the cause, named with it."""
    if exited.signal_name:
        return RankFailed(exited.error_index, f"killed by signal {exited.signal_name}")
    if failures.empty():
        return RankFailed(exited.error_index, f"exited with code {exited.exit_code}")
    rank, cause, trace = failures.get()
    stopped = [i for i, p in enumerate(processes) if i != rank and p.exitcode is not None and p.exitcode < 0]
    if stopped and cause.startswith("CollectiveTimeout"):
        return RankFailed(stopped[0], f"stopped answering (it stalled or died); rank {rank} saw: {cause}", trace)
    return RankFailed(rank, cause, trace)
