"""The stock transformers.Trainer against hetcomm's BalancedTrainer on a SIMULATED
cluster: examples/hf_trainer_bert_mlm.py's "small" BertForMaskedLM (4 layers of 128,
byte vocabulary), 128 tokens a sample, a global batch of 128, dropout 0, on 4 Gloo CPU
workers whose speeds relate as 1 : 1 : 0.5 : 0.25 (scaled to fit this machine's cores,
as the other simulated benchmarks do). The same script, model, data, optimizer and
steps; the stock Trainer gives every rank 32 samples a step, BalancedTrainer (balance
"dynamic") shares by measured speed.

Figures, over the steady steps (those after the first --warmup):

  s/step: the median step time on rank 0 (one Trainer optimizer step to the next:
      loading, compute, all-reduce, update, logging).
  over the ideal bound: s/step over the step time the cluster would take if every
      rank's work were proportional to its speed and nothing but compute took time:
      with t_i rank i's measured seconds per sample, a step of B samples takes at best
      T = B / sum_i (1 / t_i) (rank i then does T / t_i samples, all finish together).
      t_i is measured in the stock run, where every rank computes 32 samples: the
      median over its steady steps of (the wall time from Trainer's on_step_begin to
      the rank's last gradient of the step, simulated stretch included) / 32. Gloo's
      all-reduces run in the background of the backward there and are waited for only
      after the last gradient, so no wait for another rank is in it (nor, after its
      first step, in the balanced run's: its hook agrees with the other ranks once). The
      bound leaves out the loader, the all-reduce's tail and the update, which both runs
      pay.

    python benchmarks/bench_hf_trainer.py                        # ~2 minutes on 2 cores
    python benchmarks/bench_hf_trainer.py --out benchmarks/results   # hf_trainer_cpu.md
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from result_files import add_out_arguments, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import hf_trainer_bert_mlm as example  # noqa: E402

from hetcomm.loop.launch import launch  # noqa: E402
from hetcomm.simulated import speeds_for_this_machine  # noqa: E402
from hetcomm.train.config import DEFAULT_CPU_SPEEDS  # noqa: E402

GLOBAL_BATCH, SEQ, RANKS, STEPS = 128, 128, 4, 30   # as bench_hetero_bert.py
TRAINERS = {"stock transformers.Trainer": "stock", "hetcomm BalancedTrainer": "balanced"}


class Measure(example.TrainerCallback):
    """This rank, each step: the samples its training forwards took, the wall seconds
    from on_step_begin to its last gradient, and when the step ended."""

    def __init__(self):
        self.samples, self.compute_s, self.ends = [], [], []
        self.begun = self.last_gradient = None
        self.now = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def count(module, positional, named):
            if torch.is_grad_enabled() and module.training:
                self.now += len(named["input_ids"])

        def gradient(_):
            self.last_gradient = time.perf_counter()

        model.register_forward_pre_hook(count, with_kwargs=True)
        # After the example's stretch hooks (registered first): the stretch owed so far is paid.
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(gradient)

    def on_step_begin(self, args, state, control, **kwargs):
        self.now, self.begun = 0, time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.samples.append(self.now)
        self.compute_s.append(self.last_gradient - self.begun)


def on_rank(rank: int, world: int, device: torch.device, args, out: str) -> None:
    measure = Measure()
    summary, _ = example.train(rank, world, device, args, callbacks=[measure])
    rows = [None] * world
    dist.all_gather_object(rows, {"samples": measure.samples, "compute_s": measure.compute_s, "ends": measure.ends})
    if rank == 0:
        Path(out).write_text(json.dumps({"summary": summary, "ranks": rows}))


def run(trainer: str, steps: int, speeds: str, out: Path) -> dict:
    args = example.parser().parse_args(["--trainer", trainer, "--size", "small", "--seq", str(SEQ), "--dropout", "0",
                                        "--global-batch", str(GLOBAL_BATCH), "--steps", str(steps), "--speeds", speeds,
                                        "--nproc", str(RANKS), "--no-log"])
    start = time.perf_counter()
    launch(on_rank, args, str(out), nproc=RANKS, use_cuda=False)
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - start
    return result


def figures(result: dict, warmup: int) -> dict:
    """Rank 0's median step time and every rank's median seconds per sample over the
    steps after `warmup`."""
    ends = result["ranks"][0]["ends"]
    step_s = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    per_sample = [statistics.median(c / n for c, n in zip(r["compute_s"][warmup:], r["samples"][warmup:]))
                  for r in result["ranks"]]
    return {"step_s": statistics.median(step_s), "steps_timed": len(step_s), "per_sample_s": per_sample,
            "split": result["summary"]["split"], "loss": result["summary"]["losses"][-1], "wall_s": result["wall_s"]}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the figures")
    add_out_arguments(parser)
    args = parser.parse_args()
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and less than --steps")
    speeds = speeds_for_this_machine(DEFAULT_CPU_SPEEDS)
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, trainer in TRAINERS.items():
            found[label] = figures(run(trainer, args.steps, speeds, Path(tmp) / f"{trainer}.json"), args.warmup)
            print(f"{label}: {found[label]}", flush=True)
    stock, balanced = found["stock transformers.Trainer"], found["hetcomm BalancedTrainer"]
    ideal = GLOBAL_BATCH / sum(1 / t for t in stock["per_sample_s"])
    lines = ["| trainer | s/step (median) | over the ideal bound | final split | final loss |", "|---|---|---|---|---|"]
    for label, f in found.items():
        lines.append(f"| {label} | {f['step_s']:.3f} | {100 * (f['step_s'] / ideal - 1):+.1f}% | "
                     f"{'/'.join(map(str, f['split']))} | {f['loss']:.4f} |")
    lines.append(f"| ideal bound (B / sum of 1/t_i) | {ideal:.3f} | | | |")
    per_sample = {label: " / ".join(f"{1000 * t:.2f}" for t in f["per_sample_s"]) for label, f in found.items()}
    command = "python benchmarks/bench_hf_trainer.py" + (f" --steps {args.steps}" if args.steps != STEPS else "") + \
        (f" --warmup {args.warmup}" if args.warmup != 5 else "") + (f" --out {args.out}" if args.out else "")
    text = (f"SIMULATED cluster, measured {datetime.now(timezone.utc):%Y-%m-%d} on one {os.cpu_count()}-core CPU "
            f"machine ({cpu_name()}): {RANKS} Gloo workers, speed factors {speeds} (relative 1 : 1 : 0.5 : 0.25), "
            f"examples/hf_trainer_bert_mlm.py's \"small\" BertForMaskedLM (4x128), global batch {GLOBAL_BATCH} x "
            f"{SEQ} tokens, {args.steps} steps of which the first {args.warmup} are left out, torch "
            f"{torch.__version__}, transformers {transformers.__version__}.\n\n"
            f"Command: `{command}`\n\n" + "\n".join(lines) + "\n\n"
            f"BalancedTrainer / stock Trainer, seconds per step: {balanced['step_s'] / stock['step_s']:.3f} "
            f"({stock['step_s'] / balanced['step_s']:.2f}x as fast).\n\n"
            f"Measured milliseconds per sample t_i by rank, in the stock run (the bound's): "
            f"{per_sample['stock transformers.Trainer']}; in the balanced run, at its own shares (fewer samples "
            f"carry a step's fixed costs): "
            f"{per_sample['hetcomm BalancedTrainer']}. Each run's wall time with the start of its ranks: stock "
            f"{stock['wall_s']:.0f} s, balanced {balanced['wall_s']:.0f} s.")
    print(text)
    if args.out:
        write_results(args.out, "hf_trainer", text)


if __name__ == "__main__":
    main()
