"""The commit-msg hook in .githooks/ (docs/contributing.md, commit messages)."""

import importlib.machinery
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"
_loader = importlib.machinery.SourceFileLoader("commit_msg_hook", str(HOOK))
_spec = importlib.util.spec_from_loader("commit_msg_hook", _loader)
hook = importlib.util.module_from_spec(_spec)
_loader.exec_module(hook)


@pytest.mark.parametrize("message", [
    "Fuse the unscale into the unpack\n\nOne pass instead of two: 1.6x on 4M elements.\n",
    "x" * 72 + "\n",
    "Subject only",
    "\n\nLeading blank lines\n\nbody\n",
    "# a comment line first\nSubject\n\nbody\n",
    "Subject\n\nbody\n# ------------------------ >8 ------------------------\n" + "diff " * 40 + "\n",
    'Revert "' + "y" * 80 + '"\n\nThis reverts commit 0123456.\n',
    "fixup! " + "z" * 70 + "\n",
    "",
])
def test_accepts(message):
    assert hook.problems(message) == []


@pytest.mark.parametrize("message, what", [
    ("x" * 73 + "\n\nbody\n", "73 characters"),
    ("Subject\nbody straight after\n", "blank line"),
    ("é" * 73 + "\n", "73 characters"),   # characters, not bytes
])
def test_rejects(message, what):
    found = hook.problems(message)
    assert len(found) == 1 and what in found[0]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_runs_it(tmp_path):
    def git(*args, message=None):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
                               "-c", f"core.hooksPath={HOOK.parent}", *args] + (["-m", message] if message else []),
                              cwd=tmp_path, capture_output=True, text=True)

    git("init", "-q")
    assert git("commit", "-q", "--allow-empty", message="A" * 80).returncode == 1
    assert git("commit", "-q", "--allow-empty", message="Add a short subject\n\nWhy.").returncode == 0
