"""`hetcomm report RUN_DIR`: PNG plots of a run — the loss, and each rank's share of
the global batch and its throughput over time (where the balancer moved work)."""

import argparse
import os
from pathlib import Path

from hetcomm.train.runlog import read_steps

PLOTTED = ("step", "loss", "micro_batch", "samples_per_second")


def plot_run(run_dir: Path) -> list[Path]:
    steps = read_steps(run_dir, required=PLOTTED)
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
    ax.plot(x, [s["loss"] for s in steps])
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
