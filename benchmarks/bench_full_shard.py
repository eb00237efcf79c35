"""Full sharding (weights, gradients and optimizer state by memory) on the simulated CPU
cluster (4 Gloo workers, speeds 1 : 1 : 0.5 : 0.25; every figure here is from a
SIMULATED cluster), same run:

  (a) the median step of `hetcomm train --shard full` against the unsharded run and
      `--shard` (state only) on the same four workers, where all three fit (target:
      full at most 1.3x the unsharded step);
  (b) the bytes one training step sends per rank, read off the loopback interface
      around the step alone (4 Gloo processes on one host: the loopback counts every
      rank's sends; per rank is that over 4), for the unsharded step (one weighted
      all-reduce), --shard's (reduces onto the owners, broadcasts from them) and the
      full shard's (each block's weights gathered for its forward and again for its
      backward, its gradient reduced onto the owners), against a ring all-reduce's
      2 (N-1)/N x S of the same gradient (target: full at most 1.6x);
  (c) the bytes each rank holds of the model's weights, gradients and state, counted
      from the tensors it keeps, against what each would keep unsharded.

    python benchmarks/bench_full_shard.py                      # ~4 minutes on 2 cores
    python benchmarks/bench_full_shard.py --out benchmarks/results   # full_shard_cpu.md/.json
"""

import argparse
import json
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_shard import loopback_sent, train
from result_files import add_out_arguments, write_results

from hetcomm.loop import BalancedLoop
from hetcomm.loop.launch import free_port
from hetcomm.shard import Shard, ShardedAdamW
from hetcomm.simulated import CORE_SHARE, speeds_for_this_machine
from hetcomm.train.data import TokenWindows
from hetcomm.train.model import GPT, GPTConfig

GLOBAL_BATCH = 48
BLOCK = 128
SHAPE = {"n_layer": 4, "n_embd": 192, "n_head": 4}
MODEL = ["--n-layer", str(SHAPE["n_layer"]), "--n-embd", str(SHAPE["n_embd"]), "--n-head", str(SHAPE["n_head"]),
         "--block-size", str(BLOCK), "--global-batch", str(GLOBAL_BATCH), "--equal-steps", "0", "--wire", "float32"]
PARTS = (11, 11, 11, 32)
SPLIT = [12, 12, 12, 12]


def gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=256, block_size=BLOCK, dropout=0.0, **SHAPE))


def memory_for(elements: int, per_element: int) -> list[int]:
    """11/11/11/32 parts of twice what the ranks keep per element in all."""
    total = 2 * per_element * elements
    return [int(total * part / sum(PARTS)) for part in PARTS]


def one_step_bytes(rank: int, world: int, port: int, mode: str, out: str) -> None:
    """Three training steps of the GPT in `mode`; the loopback bytes and seconds of each
    step's forward, backward, reduction and update, between barriers."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)   # the same initial weights on every rank
    model = gpt()
    elements = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 256, (GLOBAL_BATCH * BLOCK * 2,), generator=torch.Generator().manual_seed(0)).numpy()
    data = TokenWindows(tokens, BLOCK)
    shard = None
    if mode == "state":
        shard = Shard(memory=memory_for(elements, 12))
    elif mode == "full":
        shard = Shard(memory=memory_for(elements, 20), weights=True)
    loop = BalancedLoop(model, data, global_batch=GLOBAL_BATCH, split=SPLIT, wire_dtype=torch.float32,
                        items_per_sample=BLOCK, overlap=True, shard=shard)
    if shard is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = ShardedAdamW(model.parameters(), loop.reducer, lr=1e-3)
    rows = []
    for step in loop.steps(4):
        dist.barrier()
        sent, start = loopback_sent(), time.perf_counter()
        for inputs, targets in step:
            step.backward(model(inputs, targets, reduction="sum")[1], reduction="sum")
        step.reduce()
        optimizer.step()
        dist.barrier()
        rows.append({"seconds": time.perf_counter() - start, "bytes": loopback_sent() - sent})
    held = held_bytes(loop, optimizer)
    everyone = [None] * world
    dist.all_gather_object(everyone, held)
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows[1:], "elements": elements, "held": everyone}))
    dist.destroy_process_group()


def held_bytes(loop, optimizer) -> dict:
    """What this rank keeps between steps, from its tensors."""
    if loop.flat is None:
        weights = sum(p.numel() * p.element_size() for p in loop.model.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in loop.model.parameters() if p.grad is not None)
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        return {"weights": weights, "gradients": grads, "state": state}
    sharded = loop.sharded_weights
    if sharded is None:
        return {"weights": loop.flat.weights.numel() * loop.flat.weights.element_size(),
                "gradients": loop.flat.grads.numel() * loop.flat.grads.element_size(),
                "state": optimizer.state_bytes()}
    return {"weights": sharded.held_bytes(), "gradients": loop.reducer.accumulator.numel() * 4,
            "state": optimizer.state_bytes(), "peak_gathered": sharded.peak_gathered}


def measure_step(mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        mp.start_processes(one_step_bytes, args=(4, free_port(), mode, str(out)), nprocs=4, start_method="spawn")
        found = json.loads(out.read_text())
    rows = found["rows"]
    return {"elements": found["elements"], "held": found["held"],
            "median_s": sorted(r["seconds"] for r in rows)[len(rows) // 2],
            "bytes_per_rank": min(r["bytes"] for r in rows) / 4}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    add_out_arguments(parser)
    args = parser.parse_args()
    speeds = [float(s) for s in speeds_for_this_machine((1.0, 1.0, 0.5, 0.25)).split(",")]
    with torch.device("meta"):
        elements = sum(p.numel() for p in gpt().parameters())
    memory_state = ",".join(str(m) for m in memory_for(elements, 12))
    memory_full = ",".join(str(m) for m in memory_for(elements, 20))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plain = train(4, speeds, args.steps, work / "plain", MODEL)
        state = train(4, speeds, args.steps, work / "state", MODEL + ["--shard", "--state-memory", memory_state])
        full = train(4, speeds, args.steps, work / "full", MODEL + ["--shard", "full", "--state-memory", memory_full])
    steps = {mode: measure_step(mode) for mode in ("plain", "state", "full")}
    gradient_bytes = elements * 4
    ring = 2 * 3 / 4 * gradient_bytes
    lines = [
        f"SIMULATED cluster, measured {datetime.now(timezone.utc):%Y-%m-%d} on one {torch.get_num_threads()}-thread "
        f"CPU machine: 4 Gloo workers, speed factors {','.join(f'{s:g}' for s in speeds)} (relative 1 : 1 : 0.5 : "
        f"0.25, scaled to keep {CORE_SHARE:.0%} of the cores busy at most), GPT {SHAPE['n_layer']}x{SHAPE['n_embd']} "
        f"({elements:,} parameters, fp32, fp32 wire), {GLOBAL_BATCH} windows x {BLOCK} tokens a step, median of "
        f"steps 2-{args.steps - 1}, torch {torch.__version__}. Memory per rank in 11/11/11/32 parts: {memory_state} "
        f"bytes (--shard), {memory_full} (--shard full).",
        "",
        "| run | median step s | tokens/s | vs unsharded |",
        "|---|---|---|---|",
    ]
    for name, run in (("unsharded", plain), ("--shard (state)", state), ("--shard full", full)):
        lines.append(f"| {name} | {run['median_step_s']:.3f} | {run['tokens_per_s']:,.0f} | "
                     f"{run['median_step_s'] / plain['median_step_s']:.3f}x |")
    lines += [
        "",
        f"Full sharding's step against the unsharded step on the same 4 workers: "
        f"**{full['median_step_s'] / plain['median_step_s']:.3f}x** (target at most 1.3x).",
        "",
        f"One training step's traffic (split {'/'.join(map(str, SPLIT))}, one micro-batch each, one thread a rank, "
        f"no simulated speed), {gradient_bytes:,} bytes of gradient; bytes the fewest of 3 steps, seconds their "
        f"median:",
        "",
        "| step | seconds | bytes sent per rank (loopback / 4) | vs a ring all-reduce's 2(N-1)/N x S |",
        "|---|---|---|---|",
    ]
    for name, mode in (("unsharded (weighted all-reduce)", "plain"), ("--shard (reduces + broadcasts)", "state"),
                       ("--shard full (2 gathers + streamed reduces)", "full")):
        row = steps[mode]
        lines.append(f"| {name} | {row['median_s']:.4f} | {row['bytes_per_rank']:,.0f} | "
                     f"{row['bytes_per_rank'] / ring:.2f}x |")
    lines += ["", "Bytes each rank keeps between steps (weights / gradients / optimizer state), from its tensors:", "",
              "| run | rank 0 | rank 1 | rank 2 | rank 3 |", "|---|---|---|---|---|"]
    for name, mode in (("unsharded", "plain"), ("--shard", "state"), ("--shard full", "full")):
        cells = [f"{h['weights']:,} / {h['gradients']:,} / {h['state']:,}" for h in steps[mode]["held"]]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    peaks = [h["peak_gathered"] for h in steps["full"]["held"]]
    lines += ["", f"Full sharding's peak of gathered weights during a step: {peaks[0]:,} bytes on every rank (the "
              f"embeddings and tied head, held throughout, and two blocks), of the model's {gradient_bytes:,}."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, "full_shard", text, {"runs": {"plain": plain, "state": state, "full": full},
                                                     "steps": steps, "speeds": speeds, "elements": elements})


if __name__ == "__main__":
    main()
