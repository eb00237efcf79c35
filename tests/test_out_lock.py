"""One live run per --out (hetcomm.train.out_lock): a second holder is refused with the
first one named, and the lock is free again once its holder ends, however it ends."""

import os
import subprocess
import sys

import pytest

from hetcomm.train.out_lock import LOCK_NAME, hold_out


def test_a_second_run_into_a_held_out_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    with hold_out(str(out)):
        with pytest.raises(ValueError, match=rf"--out {out} is in use by a live run \(PID {os.getpid()} on "):
            hold_out(str(out))
    with hold_out(str(out)):   # released when the first holder closed it
        pass


def test_a_holder_killed_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hetcomm.train.out_lock import hold_out; "
                               f"lock = hold_out({str(out)!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(ValueError, match=f"PID {holder.pid} on "):
        hold_out(str(out))
    holder.kill()
    holder.wait()
    with hold_out(str(out)):
        assert (out / LOCK_NAME).read_text().startswith(f"PID {os.getpid()} on ")
