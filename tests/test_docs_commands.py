"""Every command in README.md and docs/*.md runs as printed, so the documentation cannot drift
from the code.

The convention, shared by everyone who writes the docs:
- a fenced block tagged ```bash holds shell commands, one per line; a line starting with `#` is a
  comment, a trailing backslash continues a command on the next line, and a here-document
  (`cat > f <<'EOF'` ... `EOF`) belongs to the command that opens it;
- a fenced block tagged ```python is a complete program, run as a script;
- a block directly below a line `<!-- not run: REASON -->` is not run (a long job, a GPU, a
  download, several hosts); REASON must say why, and the test of that block is skipped with it.

Each block is one test (its id: file, line, language). A shell block's commands run in order in
one bash session (as typed into a terminal), with this interpreter's bin directory first on PATH,
in a scratch copy of the repository root (its top-level entries linked, so that what a command
writes lands in the copy, not in the tree); a Python block runs with this interpreter in an empty
scratch directory. The first non-zero exit fails the test, naming the command.
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("bash", "python")
NOT_RUN = re.compile(r"^<!--\s*not run\s*(?::(?P<reason>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
BLOCK_TIMEOUT_S = 300
# The scratch copy of the root holds links to these, never the outputs of earlier runs.
NOT_LINKED = {".git", ".pytest_cache", ".benchmarks", "runs", "gpu-results", "build", "dist"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int              # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None    # None: run it; otherwise the reason given (may be empty: an error)
    marker_misplaced: bool = False   # a not-run comment above, but separated by blank lines

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}:{self.lang}"


def blocks_of(path: Path) -> list[Block]:
    """The ```bash and ```python blocks of a Markdown file, with their not-run markers."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        lang = fence["lang"]
        if lang in LANGUAGES:
            above = lines[i - 1] if i > 0 else ""
            marker = NOT_RUN.match(above.strip())
            misplaced = False
            if not marker:
                k = i - 1
                while k >= 0 and not lines[k].strip():
                    k -= 1
                misplaced = k < i - 1 and k >= 0 and bool(NOT_RUN.match(lines[k].strip()))
            reason = None if not marker else (marker["reason"] or "").strip()
            found.append(Block(path, i + 1, lang, "\n".join(lines[i + 1:end]) + "\n", reason, misplaced))
        i = end + 1
    return found


HEREDOC = re.compile(r"<<-?\s*(['\"]?)(?P<word>\w+)\1")


def shell_commands(code: str) -> list[str]:
    """One command per line, comments and blank lines dropped, backslash continuations joined;
    a here-document stays with its command, up to its closing word."""
    commands, pending, lines = [], "", iter(code.splitlines())
    for line in lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = pending + line.strip()
        pending = ""
        heredoc = HEREDOC.search(command)
        if heredoc:
            for body in lines:
                command += "\n" + body
                if body.strip() == heredoc["word"]:
                    break
        commands.append(command)
    if pending.strip():
        commands.append(pending.strip())
    return commands


BLOCKS = [block for path in DOCS for block in blocks_of(path)]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def scratch_root(tmp: Path) -> Path:
    """A directory that looks like the repository root: its top-level entries linked, but
    for the committed results, which are copied: a documented command that writes its
    results there (--out benchmarks/results) must not rewrite the tree's."""
    copy = tmp / "repo"
    copy.mkdir()
    for entry in ROOT.iterdir():
        if entry.name in NOT_LINKED:
            continue
        if entry.name == "benchmarks":
            (copy / entry.name).mkdir()
            for inner in entry.iterdir():
                if inner.name == "results":
                    shutil.copytree(inner, copy / entry.name / inner.name)
                else:
                    (copy / entry.name / inner.name).symlink_to(inner, target_is_directory=inner.is_dir())
        else:
            (copy / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return copy


@dataclass
class Outcome:
    command: str
    returncode: int
    stdout: str
    stderr: str


_RUNS: dict[Block, Outcome] = {}


def run_block(block: Block, tmp: Path) -> Outcome:
    """Runs a block, stopping at its first failing command. Remembered, so that a test that
    checks a block's output reuses the run of that block's own test."""
    if block not in _RUNS:
        _RUNS[block] = _run(block, tmp)
    return _RUNS[block]


def shell_script(commands: list[str]) -> str:
    """The commands as one bash session (a variable or `cd` carries to the next line, as in a
    terminal) that stops at the first command that fails and names it by its index."""
    lines = ["set -o pipefail"]
    for index, command in enumerate(commands):
        lines += [command, f'__rc=$?; if [ $__rc -ne 0 ]; then echo "{FAILED} {index} $__rc" >&2; exit $__rc; fi']
    return "\n".join(lines) + "\n"


FAILED = "docs-command-failed:"


def _run(block: Block, tmp: Path) -> Outcome:
    env = environment()
    if block.lang == "python":
        work = tmp / "python"
        work.mkdir()
        script = work / "snippet.py"
        script.write_text(block.code)
        argv, cwd, commands = [sys.executable, str(script)], work, [f"python <block at line {block.line}>"]
    else:
        commands = shell_commands(block.code)
        script = tmp / "commands.sh"
        script.write_text(shell_script(commands))
        argv, cwd = ["bash", str(script)], scratch_root(tmp)
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        failed = re.search(rf"^{FAILED} (\d+) \d+$", done.stderr, re.MULTILINE)
        command = commands[int(failed[1])] if failed else commands[-1]
        return Outcome(command, done.returncode, done.stdout, done.stderr)
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else expired.stdout
        return Outcome(" ; ".join(commands), -1, stdout or "", f"timed out after {BLOCK_TIMEOUT_S} s")


def test_the_docs_hold_commands():
    assert any(block.not_run is None for block in BLOCKS), "no runnable ```bash or ```python block found"
    assert (ROOT / "docs").is_dir()


def is_loop_example(block: Block) -> bool:
    """The complete hetcomm.loop program of the guide, whose run two tests check."""
    return (block.path.name == "guide.md" and block.lang == "python" and "BalancedLoop(" in block.code
            and "launch(main)" in block.code)


# The two tests of the loop example share its run (run_block), so they go to one worker of
# `make test`'s pytest-xdist (--dist loadgroup): on two, each ran it (15-25 s).
LOOP_EXAMPLE = pytest.mark.xdist_group("docs_loop_example")


@pytest.mark.parametrize("block", [pytest.param(block, marks=[LOOP_EXAMPLE] if is_loop_example(block) else [])
                                   for block in BLOCKS], ids=[block.id for block in BLOCKS])
def test_a_documented_block_runs(block, tmp_path_factory):
    assert not block.marker_misplaced, (
        f"{block.id}: the <!-- not run: ... --> comment must be the line directly above the fence")
    if block.not_run is not None:
        assert block.not_run, f"{block.id}: a not-run block must say why: <!-- not run: REASON -->"
        pytest.skip(f"not run: {block.not_run}")
    if block.lang == "bash":
        assert shell_commands(block.code), f"{block.id}: a ```bash block without a command"
    last = run_block(block, tmp_path_factory.mktemp("docs"))
    assert last.returncode == 0, (
        f"{block.id}: `{last.command}` exited with {last.returncode}\n"
        f"--- stdout (end)\n{last.stdout[-2000:]}\n--- stderr (end)\n{last.stderr[-3000:]}")


def loop_example() -> Block:
    """The complete hetcomm.loop program of the guide."""
    matches = [block for block in BLOCKS if is_loop_example(block)]
    assert len(matches) == 1, "docs/guide.md should hold one complete BalancedLoop program"
    return matches[0]


@LOOP_EXAMPLE
def test_the_loop_example_learns(tmp_path_factory):
    """Beyond running: the guide's loop example learns and deals the whole global batch."""
    block = loop_example()
    assert block.not_run is None
    outcome = run_block(block, tmp_path_factory.mktemp("docs"))
    assert outcome.returncode == 0, outcome.stderr[-3000:]
    loss, split = outcome.stdout.strip().splitlines()[-1].split(", split ")
    assert float(loss.removeprefix("loss ")) < 1.0   # it learned (about 4.2 at the start)
    assert sum(int(n) for n in re.findall(r"\d+", split)) == 64


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
# Pages other engineers own and write; until they land, a link to them is reported, not failed.
PENDING_PAGES = {"docs/planner.md", "docs/contributing.md"}


def anchors(page: Path) -> set[str]:
    """The #anchors of a Markdown page's headings, as GitHub makes them: lower case, spaces
    to hyphens, punctuation other than hyphens and underscores dropped."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_point_at_files(path):
    """A link to a file of the repository (results, sources, other pages) that exists, and
    to a heading of a page that it has."""
    missing = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        file = (path.parent / target.split("#")[0]).resolve()
        if not file.exists():
            missing.append(file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else target)
        elif "#" in target and file.suffix == ".md" and target.split("#", 1)[1] not in anchors(file):
            missing.append(target)
    broken = [target for target in missing if target not in PENDING_PAGES]
    assert not broken, f"{path.name} links to files or headings that do not exist: {broken}"
    if missing:
        pytest.skip(f"links to pages not written yet: {', '.join(sorted(set(missing)))}")


def test_the_front_page_stays_short():
    """README.md is the front page: what hetcomm is, the quick start, one example of each
    way in, the key figures; the rest belongs in docs/."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < 200, f"README.md has {lines} lines; move detail to docs/ (the front page stays under 200)"
