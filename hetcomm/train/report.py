"""`hetcomm report RUN_DIR`: PNG plots of a run — the loss, and each rank's share of
the global batch and its throughput over time (where the balancer moved work)."""

import argparse
import json
import math
import os
import sys
from pathlib import Path

from hetcomm.train.runlog import read_steps

PLOTTED = ("step", "loss", "micro_batch", "samples_per_second")


def check_run(run_dir: Path, steps: list[dict]) -> list[str]:
    """What the plots cannot show but the reader must know, one line each: losses that are
    not finite (gaps in the plot), a run without its summary (unfinished, or the summary
    damaged). Raises ValueError naming the line of a record whose per-rank lists do not
    hold one value per rank."""
    ranks = len(steps[0]["micro_batch"])
    for number, record in enumerate(steps, 1):
        for key in ("micro_batch", "samples_per_second"):
            if not isinstance(record[key], list) or len(record[key]) != ranks:
                raise ValueError(f"{run_dir / 'steps.jsonl'}, record {number}: {key} = {record[key]!r}: expected "
                                 f"a list of {ranks} values, one per rank, as the first record has")
    warnings = []
    bad = [s["step"] for s in steps if not (isinstance(s["loss"], (int, float)) and math.isfinite(s["loss"]))]
    if bad:
        warnings.append(f"the loss is not a finite number at {len(bad)} of {len(steps)} steps (first at step "
                        f"{bad[0]}): gaps in loss.png")
    summary = run_dir / "summary.json"
    try:
        json.loads(summary.read_text())
    except FileNotFoundError:
        warnings.append(f"{summary}: none; the run did not finish (or still runs): plotted from its "
                        f"{len(steps)} logged steps")
    except (OSError, ValueError) as error:
        warnings.append(f"{summary}: not readable as JSON ({error}); plotted from steps.jsonl alone")
    return warnings


def plot_run(run_dir: Path) -> list[Path]:
    steps = read_steps(run_dir, required=PLOTTED)
    for warning in check_run(run_dir, steps):
        print(f"hetcomm report: warning: {warning}", file=sys.stderr)
    # Checked before drawing, so that a read-only run gets one message and no half of the plots.
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise PermissionError(f"{run_dir}: cannot write the plots there (not writable)")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    simulated = " (simulated cluster)" if steps[0].get("simulated") else ""
    x = [s["step"] for s in steps]
    ranks = len(steps[0]["micro_batch"])
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [s["loss"] if isinstance(s["loss"], (int, float)) else math.nan for s in steps])
    ax.set(xlabel="step", ylabel="loss (mean over the global batch)", title=f"Training loss{simulated}")
    ax.grid(alpha=0.3)
    written.append(run_dir / "loss.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    fig, (share_ax, speed_ax) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for rank in range(ranks):
        share_ax.plot(x, [s["micro_batch"][rank] / sum(s["micro_batch"]) for s in steps], label=f"rank {rank}")
        speed_ax.plot(x, [s["samples_per_second"][rank] for s in steps], label=f"rank {rank}")
    share_ax.set(ylabel="share of the global batch", title=f"Balance per rank{simulated}")
    speed_ax.set(xlabel="step", ylabel="samples / s of compute")
    for ax in (share_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    written.append(run_dir / "balance.png")
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hetcomm report", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        for path in plot_run(args.run_dir):
            print(path)
    except (OSError, ValueError) as error:
        parser.exit(2, f"hetcomm report: error: {error}\n")
    return 0
