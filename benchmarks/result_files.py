"""One naming scheme for the files in benchmarks/results/, and the writer the benchmark
scripts share (their `--out DIR` option):

    <benchmark>[_<variant>]_<machine>.{md,json}

benchmark: the script's name without bench_ (allreduce, hetero_bert, ...); variant: a
configuration worth its own file (1gbit, loopback, common); machine: `cpu` for a run on
CPUs (the 2-core CI machine so far), a GPU's short name (gtx1080ti, v100) for a run on a
GPU, left out where the benchmark's name already ends with it (ops_cpu). No date and no
run number: one set per benchmark, variant and machine, so a link to it never goes stale;
a new run replaces the set, and git history keeps the old ones. Repeats of one version go
into one set (the repeated scripts take --repeats N). The .md holds the table, a first
line saying what was measured where and when, and a last line naming the commit; the
.json the raw figures.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# What the scheme used to add after the machine: _<date>[_run<N>].
_DATED = r"_\d{4}-\d{2}-\d{2}(_run\d+)?"


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def gpu_tag(name: str) -> str:
    """A CUDA device name as a file-name part: 'NVIDIA GeForce GTX 1080 Ti' -> 'gtx1080ti'."""
    name = re.sub(r"\b(nvidia|geforce|tesla|quadro)\b", "", name.lower())
    return re.sub(r"[^a-z0-9]+", "", name) or "gpu"


def result_stem(benchmark: str, *, variant: str | None = None, machine: str = "cpu") -> str:
    """The file name without its suffix, e.g. result_stem("allreduce", variant="1gbit")."""
    parts = [benchmark]
    if variant:
        parts.append(re.sub(r"[^A-Za-z0-9-]+", "p", variant))  # 0.5gbit -> 0p5gbit: no dots in a stem
    if not benchmark.endswith("_" + machine):
        parts.append(machine)
    return "_".join(parts)


def add_out_arguments(parser: argparse.ArgumentParser) -> None:
    """--out DIR, as every benchmark script that keeps results spells it."""
    parser.add_argument("--out", metavar="DIR",
                        help=f"write the .md and .json under DIR with the standard name, replacing the set there "
                             f"(results go to {RESULTS_DIR.parent.name}/{RESULTS_DIR.name})")


def source_commit() -> str:
    """The commit the code ran from, '-dirty' when the tree had changes: a set's name no
    longer says when it was made, so its text says from what."""
    described = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=RESULTS_DIR.parent,
                               capture_output=True, text=True)
    return described.stdout.strip() if described.returncode == 0 else "unknown"


def older_files(out_dir: Path, stem: str) -> list[Path]:
    """The same set's files under the scheme that put the date and run number in the name."""
    pattern = re.compile(re.escape(stem) + _DATED + r"\.(md|json)$")
    return sorted(p for p in out_dir.iterdir() if pattern.match(p.name))


def write_results(out_dir: str | Path, benchmark: str, markdown: str, data=None, **name) -> list[Path]:
    """Writes <stem>.md (and <stem>.json when `data` is given) under `out_dir`, `name` going
    to result_stem, and removes what else the set had there: a .json that this run has no
    data for, and dated files of the older scheme. The set is replaced, never added to."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem(benchmark, **name)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    for old in older_files(out_dir, stem) + ([js] if data is None and js.exists() else []):
        old.unlink()
        print(f"removed {old}")
    md.write_text(f"{markdown.rstrip()}\n\nWritten {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from commit "
                  f"{source_commit()}.\n")
    paths = [md]
    if data is not None:
        js.write_text(json.dumps(data, indent=1) + "\n")
        paths.append(js)
    print("wrote " + " and ".join(str(p) for p in paths))
    return paths
