"""Records the step times of two equal CPU ranks (no simulated speed) training a small
tagger through BalancedLoop on this host, as logs replay_rebalancer.py replays: how
noisy a rank's measured speed is when the host is shared and its steps take tens of
milliseconds, the case where two equal ranks were seen to go [16, 16] -> [6, 26] ->
[27, 5] -> [11, 21] of 32.

Each repeat runs once with dynamic balancing (the loop's first split from its timed
first step, then the rebalancer, as a user's run goes) and once at the fixed equal split
(the noise alone, at the sizes the ranks ran). Every step's log holds each rank's dealt
and done samples and its compute seconds.

    python benchmarks/record_equal_ranks.py --out benchmarks/results   # equal_ranks_cpu.md/.json, ~1 minute
"""

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
from result_files import add_out_arguments, write_results
from torch import nn

from hetcomm.loop import BalancedLoop
from hetcomm.loop.launch import launch

GLOBAL_BATCH = 32
MODES = {"hetcomm": {}, "hetcomm at the equal split": {"split": [GLOBAL_BATCH // 2] * 2}}


class Sequences(torch.utils.data.Dataset):
    """Sample i: 64 random tokens; the target of a token is 7 times it, mod 64."""

    def __init__(self, size: int = 4096):
        self.tokens = torch.randint(0, 64, (size, 64), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "targets": (self.tokens[i] * 7) % 64}


def train(rank: int, world: int, device: torch.device, steps: int, options: dict, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 64)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    loop = BalancedLoop(model, Sequences(), global_batch=GLOBAL_BATCH, wire_dtype=torch.float32, **options)
    log = []
    for step in loop.steps(steps):
        for batch in step:
            logits = model(batch["tokens"])
            step.backward(nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten()))
        result = step.reduce()
        optimizer.step()
        log.append({"step": result.number, "phase": result.regime, "micro_batch": list(result.split),
                    "samples": [r.samples for r in result.ranks], "compute_s": [r.compute_s for r in result.ranks],
                    "samples_per_second": [r.samples / r.compute_s if r.samples else 0.0 for r in result.ranks],
                    "handoff": result.handoff is not None})
    if rank == 0:
        Path(out).write_text(json.dumps(log))


def table(rows: list[dict]) -> str:
    lines = ["| repeat | strategy | splits dealt, steps 0-7 | changes | rank 1 over rank 0, seconds per sample: "
             "median, 10th-90th percentile |", "|---|---|---|---|---|"]
    for row in rows:
        steps = row["steps"]
        changes = sum(a["micro_batch"] != b["micro_batch"] for a, b in zip(steps, steps[1:]))
        ratios = [(s["compute_s"][1] / s["samples"][1]) / (s["compute_s"][0] / s["samples"][0])
                  for s in steps[1:] if min(s["samples"]) > 0]
        deciles = statistics.quantiles(ratios, n=10)
        dealt = " ".join("/".join(map(str, s["micro_batch"])) for s in steps[:8])
        lines.append(f"| {row['repeat'] + 1} | {row['strategy']} | {dealt} | {changes} | "
                     f"{statistics.median(ratios):.3f}, {deciles[0]:.3f}-{deciles[-1]:.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    add_out_arguments(parser)
    args = parser.parse_args()
    rows = []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            for strategy, options in MODES.items():
                out = Path(folder) / "log.json"
                launch(train, args.steps, options, str(out), nproc=2, use_cuda=False)
                rows.append({"repeat": repeat, "scenario": "steady", "strategy": strategy,
                             "steps": json.loads(out.read_text())})
    text = (f"Two equal CPU ranks (Gloo, one thread each, no simulated speed) on a {os.cpu_count()}-core host "
            f"whose 1-minute load average was {load:.1f} at the start, a 2-layer tagger on 64-token samples, "
            f"global batch {GLOBAL_BATCH}, {args.steps} steps a run (python benchmarks/record_equal_ranks.py). "
            f"The step logs, for benchmarks/replay_rebalancer.py, are in the .json.\n\n{table(rows)}")
    print(text)
    if args.out:
        write_results(args.out, "equal_ranks", text, rows)


if __name__ == "__main__":
    main()
