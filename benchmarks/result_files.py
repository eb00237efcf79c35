"""One naming scheme for the files in benchmarks/results/, and the writer the benchmark
scripts share (their `--out DIR` option):

    <benchmark>[_<variant>]_<machine>_<date>[_run<N>].{md,json}

benchmark: the script's name without bench_ (allreduce, hetero_bert, ...); variant: a
configuration worth its own file (1gbit, loopback, common); machine: `cpu` for a run on
CPUs (the 2-core CI machine so far), a GPU's short name (gtx1080ti, v100) for a run on a
GPU, left out where the benchmark's name already ends with it (ops_cpu); date: the UTC
day of the run, ISO; run<N>: repeats of one version, kept together. The .md holds the
table and a first line saying what was measured where; the .json the raw figures.
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import datetime, timezone
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def gpu_tag(name: str) -> str:
    """A CUDA device name as a file-name part: 'NVIDIA GeForce GTX 1080 Ti' -> 'gtx1080ti'."""
    name = re.sub(r"\b(nvidia|geforce|tesla|quadro)\b", "", name.lower())
    return re.sub(r"[^a-z0-9]+", "", name) or "gpu"


def result_stem(benchmark: str, *, variant: str | None = None, machine: str = "cpu", date: str | None = None,
                run: int | None = None) -> str:
    """The file name without its suffix, e.g. result_stem("allreduce", variant="1gbit")."""
    parts = [benchmark]
    if variant:
        parts.append(re.sub(r"[^A-Za-z0-9-]+", "p", variant))  # 0.5gbit -> 0p5gbit: no dots in a stem
    if not benchmark.endswith("_" + machine):
        parts.append(machine)
    parts.append(date or today())
    if run is not None:
        parts.append(f"run{run}")
    return "_".join(parts)


def add_out_arguments(parser: argparse.ArgumentParser) -> None:
    """--out DIR and --run N, as every benchmark script that keeps results spells them."""
    parser.add_argument("--out", metavar="DIR",
                        help=f"write the .md and .json under DIR with the standard name (results go to "
                             f"{RESULTS_DIR.parent.name}/{RESULTS_DIR.name})")
    parser.add_argument("--run", type=int, metavar="N", help="one of several repeats: adds _runN to the name")


def write_results(out_dir: str | Path, benchmark: str, markdown: str, data=None, **name) -> list[Path]:
    """Writes <stem>.md (and <stem>.json when `data` is given) under `out_dir`; `name` goes to
    result_stem. Refuses to overwrite: a second run of the day is a repeat (--run N)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / result_stem(benchmark, **name)
    paths = [Path(f"{stem}.md")] + ([Path(f"{stem}.json")] if data is not None else [])
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise SystemExit(f"{', '.join(existing)} already exists: move it away, or name this run a repeat (--run N)")
    paths[0].write_text(markdown.rstrip("\n") + "\n")
    if data is not None:
        paths[1].write_text(json.dumps(data, indent=1) + "\n")
    print("wrote " + " and ".join(str(p) for p in paths))
    return paths
