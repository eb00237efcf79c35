"""Mutation check of the Python layer: seeds one realistic bug at a time into a copy of
hetcomm/ (the weighted reducer, the balancer, the checkpoints), runs the test files that
should catch it against that copy, and records whether they fail, which test fails
first and how long it took. The unmutated copy runs the same files first and must pass.
A mutant that the tests do not kill is a bug the test suite lets through; the script
exits with 1 if there is one. The Python-layer sibling of emulator_mutants.py.

The copy (the compiled hetcomm/_C included) goes into a scratch directory that is put
first on PYTHONPATH and made the tests' working directory, so that `import hetcomm`
finds it before the editable install's finder, which sits after the path finder; the
worker processes the tests start inherit both. A check at the start proves it: the
copy's hetcomm/__file__ is the one imported, in pytest's process and in a forkserver
worker. --tests DIR runs the same mutants against another version of the test suite
(the tests/ of an older commit), to show that a change to the tests still catches them.

    python benchmarks/seeded_bugs.py                       # every mutant, table on stdout
    python benchmarks/seeded_bugs.py --out benchmarks/results   # seeded_bugs_cpu.md/.json
    python benchmarks/seeded_bugs.py sampler_overlap       # some of them
    git worktree add /tmp/old-tests 05f4796
    python benchmarks/seeded_bugs.py --tests /tmp/old-tests/tests   # the older test suite
"""

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from result_files import add_out_arguments, write_results

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hetcomm"

# name: (file under hetcomm/, text, replacement, the bug, the test files that should catch it)
MUTANTS = {
    "weight_one_over_world": (
        "comm/weights.py", "return Share(weight=self.value / total, total=total, by_count=True,",
        "return Share(weight=1.0 / world, total=total, by_count=True,",
        "the reducer's weight n_i / N replaced by 1 / world (DDP's plain average) when counts are given",
        ["test_reducer.py", "test_reducer_expected.py"]),
    "loss_scale_multiplied": (
        "comm/reducer.py", "scalar_on(1.0 if loss_scale is None else loss_scale, device).reciprocal(),",
        "scalar_on(1.0 if loss_scale is None else loss_scale, device),",
        "the loss scale multiplied into the reduced gradient instead of divided out (begin(), reduce(weight=...))",
        ["test_reducer.py"]),
    "solver_ties_all_rounded_up": (
        "balance/solver.py", "return base + torch.minimum((missing - before).clamp(min=0), room)",
        "return base + room",
        "the split solver gives a sample to every rank that can finish one more by the optimum, not only to as "
        "many as are missing: with ties the split no longer sums to the global batch",
        ["test_balance_solver.py"]),
    "sampler_overlap": (
        "balance/sampler.py", "start += sum(shares[:rank])", "start += rank * shares[rank]",
        "the sampler starts a rank's indices at rank × its own share (right for an equal split only): unequal "
        "splits deal overlapping indices and skip others within an epoch",
        ["test_balance_sampler.py"]),
    "rebalancer_inverted": (
        "balance/rebalancer.py", "elif self.steps_since_change < self.cooldown or gain <= required:",
        "elif self.steps_since_change < self.cooldown or gain >= required:",
        "the rebalancer's threshold comparison inverted: its patience counts the steps without a gain over the "
        "required one and restarts at a step with one",
        ["test_balance_rebalancer.py"]),
    "handoff_sources_off_by_one": (
        "balance/handoff.py", "out.append((giver, kept + lo - offset, hi - lo))",
        "out.append((giver, kept + 1 + lo - offset, hi - lo))",
        "the handoff's sources start one past the giver's last kept sample: one given-up sample is done by "
        "nobody and one past the giver's share is asked for",
        ["test_balance_handoff.py"]),
    "digest_mismatch_ignored": (
        "files/verified.py", "if written.get(name) != found.get(name):",
        "if (name in written) != (name in found):",
        "checkpoint.load refuses a tensor missing on one side only: a tensor whose bytes no longer match its "
        "digest (damaged or edited) loads",
        ["test_faults.py"]),
    "sampler_cursor_not_restored": (
        "balance/sampler.py", 'self.epoch, self.cursor = state["epoch"], state["cursor"]',
        'self.epoch = state["epoch"]',
        "the sampler's cursor not restored on load: a resumed run starts its epoch over, repeating samples",
        ["test_balance_sampler.py"]),
    "non_tensors_undigested": (
        "files/verified.py", "found[NON_TENSORS] = values_digest(state)",
        'found[NON_TENSORS] = ""',
        "the checkpoint's digest of what is not a tensor (step, sampler position, split, loss scale) left empty: an "
        "edited step or sampler position loads",
        ["test_faults.py"]),
    "changed_data_resumed": (
        "train/launch.py", "if recorded is None or recorded == now or config.data_changed:",
        "if recorded is None or recorded or config.data_changed:",
        "the launcher's data check skipped: a resume on regenerated data is let through to the workers",
        ["test_faults.py"]),
    "loop_fingerprint_ignored": (
        "loop/balanced_loop.py", "and not data_changed:", "and data_changed:",
        "BalancedLoop.load_state_dict continues on data of another fingerprint unless told it changed",
        ["test_loop.py"]),
    "peer_named_for_a_killed_rank": (
        "loop/launch.py", "if exited.signal_name:", "if exited.signal_name and failures.empty():",
        "a rank killed by a signal is named only when no peer queued an error: the peer that lost its connection "
        "is named instead",
        ["test_faults.py"]),
}

PYTEST_OPTIONS = ["-x", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=line"]
TIMEOUT_S = 900
# A short-summary line: FAILED path::test[params, spaces and all] - message
FAILED = re.compile(r"^(FAILED|ERROR) (\S+?::.+?)(?: - .*)?$")
# What the check at the start runs in the copy's directory: hetcomm's file here and in a
# forkserver worker (the tests' ranks start from one, with hetcomm preloaded).
WHERE = """\
import multiprocessing as mp
import hetcomm

def where():
    import hetcomm
    return hetcomm.__file__

if __name__ == "__main__":
    mp.set_forkserver_preload(["hetcomm"])
    with mp.get_context("forkserver").Pool(1) as pool:
        print(hetcomm.__file__)
        print(pool.apply(where))
"""


def copy_package(work: Path, name: str) -> Path:
    """hetcomm/ copied (compiled extension included, bytecode caches not) to work/name/;
    returns work/name, the directory that goes on PYTHONPATH."""
    site = work / name
    shutil.copytree(PACKAGE, site / "hetcomm", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def environment(site: Path) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))


def check_import(site: Path) -> list[str]:
    """The hetcomm/__init__.py that the copy's environment imports, in the process and in
    a forkserver worker; raises SystemExit unless both are the copy's."""
    (site / "where.py").write_text(WHERE)
    result = subprocess.run([sys.executable, "where.py"], env=environment(site), cwd=site, capture_output=True,
                            text=True, timeout=120)
    found = result.stdout.split()
    expected = str(site / "hetcomm" / "__init__.py")
    if result.returncode != 0 or found != [expected, expected]:
        raise SystemExit(f"the copy of hetcomm/ is not what the tests would import: expected {expected} twice, "
                         f"got {found or result.stderr[-2000:]}")
    return found


def run_tests(site: Path, tests: Path, files: list[str]) -> dict:
    present = [f for f in files if (tests / f).is_file()]
    missing = [f for f in files if f not in present]
    if not present:
        return {"exit_code": None, "summary": "no test files", "first_failure": "", "seconds": 0.0,
                "missing_files": missing, "output_tail": ""}
    command = [sys.executable, "-m", "pytest", *PYTEST_OPTIONS, *[str(tests / f) for f in present]]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, env=environment(site), cwd=site, capture_output=True, text=True,
                                timeout=TIMEOUT_S)
        exit_code, stdout = result.returncode, result.stdout
    except subprocess.TimeoutExpired as error:
        exit_code = None
        stdout = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else error.stdout or ""
    seconds = time.perf_counter() - start
    lines = stdout.splitlines()
    failures = [m for line in lines if (m := FAILED.match(line))]
    first = ""
    if failures:
        kind, node = failures[0][1], failures[0][2]
        path, _, test = node.partition("::")
        first = f"{Path(path).name}::{test}" + (" (error)" if kind == "ERROR" else "")
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)", line)),
                   "timed out" if exit_code is None else "")
    return {
        "exit_code": exit_code,
        "summary": summary + (f" after {TIMEOUT_S} s (timed out)" if exit_code is None and summary else ""),
        "first_failure": first,
        "seconds": round(seconds, 1),
        "missing_files": missing,
        "output_tail": "\n".join(lines[-15:]) if exit_code not in (0, 1) else "",
    }


def mutate(site: Path, name: str) -> None:
    path, old, new, _, _ = MUTANTS[name]
    target = site / "hetcomm" / path
    text = target.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{name}: the text to mutate is not found exactly once in hetcomm/{path}; update MUTANTS")
    target.write_text(text.replace(old, new))


def table(rows: list[dict]) -> str:
    out = ["| mutant | file | the bug | caught | first failing test | tests run | seconds |",
           "|---|---|---|---|---|---|---|"]
    for row in rows:
        caught = "yes" if row["caught"] else "**NO**" if row["exit_code"] == 0 else f"**NO** ({row['summary']})"
        out.append(f"| {row['name']} | hetcomm/{row['file']} | {row['bug']} | {caught} | "
                   f"{row['first_failure'].replace('|', '/')} | {', '.join(row['files'])} | {row['seconds']} |")
    return "\n".join(out)


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else None
    return found[1] if found else platform.machine()


def tests_commit(tests: Path) -> str:
    """The commit the tests directory is checked out at, '+changes' when it has
    uncommitted ones (the tree's own tests/ while someone edits them)."""
    head = subprocess.run(["git", "-C", str(tests), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "not a git checkout"
    changed = subprocess.run(["git", "-C", str(tests), "status", "--porcelain", "--", "."], capture_output=True,
                             text=True)
    return head.stdout.strip() + (" +changes" if changed.stdout.strip() else "")


def shown(tests: Path) -> str:
    """The tests directory as the results name it: relative to the repository when in it."""
    return f"{tests.relative_to(ROOT)}/" if tests.is_relative_to(ROOT) else str(tests)


def write_mutant_results(out_dir: str, meta: dict, rows: list[dict]) -> None:
    total = meta["baseline_seconds"] + sum(row["seconds"] for row in rows)
    write_results(
        out_dir, "seeded_bugs",
        f"Seeded-bug check of the Python layer, {meta['date']}, {meta['cpus']}-core {meta['machine']}, "
        f"torch {meta['torch']}: each mutant seeded alone into a copy of hetcomm/, then "
        f"`pytest {' '.join(PYTEST_OPTIONS[:4])}` over the test files listed for it, from {meta['tests']} at "
        f"{meta['tests_commit']}. Unmutated: {meta['baseline']} in {meta['baseline_seconds']} s; "
        f"{total:.0f} s in all.\n\n{table(rows)}\n",
        {**meta, "mutants": rows})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutants", nargs="*", default=list(MUTANTS), help="names from MUTANTS (default: all)")
    parser.add_argument("--tests", metavar="DIR", default=str(ROOT / "tests"),
                        help="the test directory to run (default: this repository's tests/)")
    add_out_arguments(parser)
    args = parser.parse_args()
    unknown = [name for name in args.mutants if name not in MUTANTS]
    if unknown:
        parser.error(f"unknown mutants {unknown}; known: {', '.join(MUTANTS)}")
    tests = Path(args.tests).resolve()
    if not tests.is_dir():
        parser.error(f"--tests {args.tests}: no such directory")
    files = sorted({f for name in args.mutants for f in MUTANTS[name][4]})
    commit = tests_commit(tests)
    print(f"tests: {tests} at {commit}", flush=True)

    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hetcomm-seeded-") as work:
        work = Path(work)
        site = copy_package(work, "unmutated")
        imported = check_import(site)
        print(f"imported from the copy: {imported[0]} (and in a forkserver worker)", flush=True)
        baseline = run_tests(site, tests, files)
        print(f"unmutated: {baseline['summary']} over {', '.join(files)} ({baseline['seconds']} s)", flush=True)
        if baseline["exit_code"] != 0:
            print(baseline["output_tail"] or baseline["first_failure"], file=sys.stderr)
            raise SystemExit("the unmutated copy must pass first")
        for name in args.mutants:
            site = copy_package(work, name)
            mutate(site, name)
            result = run_tests(site, tests, MUTANTS[name][4])
            # Caught: the tests failed (exit 1), not a crash or a timeout of the test run itself.
            row = {"name": name, "file": MUTANTS[name][0], "bug": MUTANTS[name][3], "files": MUTANTS[name][4],
                   "caught": result["exit_code"] == 1, **result}
            if not row["caught"]:
                # A survivor must not be the unmutated package imported by mistake.
                row["imported"] = check_import(site)[0]
            rows.append(row)
            print(f"{name}: {'caught' if row['caught'] else 'SURVIVED'}, {result['summary']} ({result['seconds']} s)"
                  f"\n    {result['first_failure']}", flush=True)
            if result["output_tail"]:
                print(result["output_tail"], flush=True)

    print(table(rows))
    print(f"{time.perf_counter() - started:.0f} s in all")
    if args.out:
        import torch

        meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": cpu_model(),
                "cpus": os.cpu_count(), "torch": torch.__version__, "tests": shown(tests), "tests_commit": commit,
                "imported": imported[0], "baseline": baseline["summary"], "baseline_files": files,
                "baseline_seconds": baseline["seconds"]}
        write_mutant_results(args.out, meta, rows)
    return 0 if all(row["caught"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
