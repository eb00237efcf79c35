"""One live run per run directory: a second `hetcomm train` into the --out of a run that
is still going (a relaunch while the old workers live on, a command started twice) would
interleave two runs' checkpoints and log lines there.

The lock is an flock on a file in --out, held by the process that launched the run (under
torchrun, by rank 0's worker) until it exits: the kernel releases it however the process
ends, so a killed run never leaves a stale lock. The file names the holder for the
refusal's message."""

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO

LOCK_NAME = ".hetcomm-train.lock"


def hold_out(out: str) -> IO:
    """Takes --out for this process; keep the returned file open for as long as the run
    goes. Raises ValueError naming the live run that holds it."""
    Path(out).mkdir(parents=True, exist_ok=True)
    lock = open(Path(out) / LOCK_NAME, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a process that has not said which"
        lock.close()
        raise ValueError(f"--out {out} is in use by a live run ({holder}); stop it first, or pass another "
                         f"--out") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"PID {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    lock.flush()
    return lock
