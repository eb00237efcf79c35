"""Sharded optimizer state on the simulated CPU cluster (4 Gloo workers, speeds
1 : 1 : 0.5 : 0.25; every figure here is from a SIMULATED cluster), same run:

  (a) tokens/s of `hetcomm train --shard` on all four workers, each given memory for
      state such that the whole state fits the slow fourth worker only (11/11/11/32
      parts of 2.6x the AdamW moments), against the unsharded run on the workers it fits: the
      fourth alone;
  (b) the sharded step's time against the unsharded step's on all four workers, where
      both fit (target: at most 1.15x on Gloo);
  (c) the bytes a step's gradient exchange sends per rank, read off the loopback
      interface around the collectives alone, against one all-reduce of the same
      gradient, with their times: the owner-wise reduces and broadcasts of the 11/11/11/32
      layout against one all-reduce (4 Gloo processes on one host: the loopback counts
      every rank's sends; per rank is that over 4).

    python benchmarks/bench_shard.py                      # ~4 minutes on 2 cores
    python benchmarks/bench_shard.py --out benchmarks/results   # shard_cpu.md/.json
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from result_files import add_out_arguments, write_results

from hetcomm.shard import FlatParameters, ShardedAdamW, ShardedReducer, layout_by_memory
from hetcomm.simulated import CORE_SHARE, speeds_for_this_machine
from hetcomm.loop.launch import free_port

GLOBAL_BATCH = 48
MODEL = ["--n-layer", "2", "--n-embd", "192", "--n-head", "4", "--block-size", "128", "--global-batch",
         str(GLOBAL_BATCH), "--equal-steps", "0", "--wire", "float32"]
MEMORY_PARTS = (11, 11, 11, 32)


def state_memory(elements: int) -> list[int]:
    """11/11/11/32 parts of 2.6x the AdamW moments of an fp32 model (8 bytes an element):
    the fourth worker's part holds them all, each other's a third of them; sharded, an
    owner needs 12 bytes an element (the moments and the check's scratch), 1.7x over."""
    total = 2.6 * 8 * elements
    return [int(total * part / sum(MEMORY_PARTS)) for part in MEMORY_PARTS]


def model_elements() -> int:
    from hetcomm.train.model import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=192, dropout=0.0))
    return sum(p.numel() for p in model.parameters())


def train(workers: int, speeds: list[float], steps: int, out: Path, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "hetcomm", "train", "--nproc", str(workers), "--speeds",
               ",".join(f"{s:g}" for s in speeds), "--steps", str(steps), "--out", str(out), "--no-progress",
               *MODEL, *extra]
    subprocess.run(command, check=True, capture_output=True, text=True)
    log = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    times = sorted(line["step_s"] for line in log[2:])   # past the first steps' timing and warm-up
    median = times[len(times) // 2]
    return {"median_step_s": median, "tokens_per_s": GLOBAL_BATCH * 128 / median, "steps": len(log)}


def loopback_sent() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    return 0


def exchange(rank: int, world: int, port: int, elements: int, out: str) -> None:
    """One all-reduce of the gradient, then one sharded exchange (reduces onto owners,
    broadcasts from them), each timed and its loopback bytes counted, 5 times."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    params = [torch.nn.Parameter(torch.randn(elements))]
    plain = torch.randn(elements)
    flat = FlatParameters(params, "bench")
    layout = layout_by_memory(state_memory(elements), elements, torch.float32, 25 * 2**18, "bench")
    reducer = ShardedReducer(flat, layout, wire_dtype=torch.float32)
    optimizer = ShardedAdamW(params, reducer)
    rows = []
    for _ in range(5):
        for name, run in (("all-reduce", lambda: dist.all_reduce(plain)),
                          ("reduces onto owners + broadcasts", lambda: (reducer.reduce(weight=1 / world),
                                                                        optimizer.all_gather()))):
            dist.barrier()
            sent, start = loopback_sent(), time.perf_counter()
            run()
            dist.barrier()
            rows.append({"what": name, "seconds": time.perf_counter() - start, "bytes": loopback_sent() - sent})
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "sizes": layout.sizes()}))
    dist.destroy_process_group()


def measure_exchange(elements: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "exchange.json"
        mp.start_processes(exchange, args=(4, free_port(), elements, str(out)), nprocs=4, start_method="spawn")
        found = json.loads(out.read_text())
    summary = {}
    for name in ("all-reduce", "reduces onto owners + broadcasts"):
        rows = [r for r in found["rows"] if r["what"] == name]
        summary[name] = {"median_s": sorted(r["seconds"] for r in rows)[len(rows) // 2],
                         "bytes_per_rank": sorted(r["bytes"] for r in rows)[len(rows) // 2] / 4}
    return {"sizes": found["sizes"], **summary}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    add_out_arguments(parser)
    args = parser.parse_args()
    speeds = [float(s) for s in speeds_for_this_machine((1.0, 1.0, 0.5, 0.25)).split(",")]
    elements = model_elements()
    memory = ",".join(str(m) for m in state_memory(elements))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sharded = train(4, speeds, args.steps, work / "sharded", ["--shard", "--state-memory", memory])
        fits_alone = train(1, speeds[3:], args.steps, work / "alone", [])
        unsharded = train(4, speeds, args.steps, work / "unsharded", [])
    wire = measure_exchange(elements)
    gradient_bytes = elements * 4
    ring = 2 * 3 / 4 * gradient_bytes
    lines = [
        f"SIMULATED cluster, measured {datetime.now(timezone.utc):%Y-%m-%d} on one {torch.get_num_threads()}-thread "
        f"CPU machine: 4 Gloo workers, speed factors {','.join(f'{s:g}' for s in speeds)} (relative 1 : 1 : 0.5 : "
        f"0.25, scaled to keep {CORE_SHARE:.0%} of the cores busy at most), GPT 2x192 ({elements:,} parameters, fp32, "
        f"fp32 wire), {GLOBAL_BATCH} windows x 128 tokens a step, median of steps 2-{args.steps - 1}, torch "
        f"{torch.__version__}. Memory for state: {memory} bytes (11/11/11/32 parts of 2.6x the {8 * elements:,} "
        f"bytes of AdamW moments): unsharded, the state fits the fourth worker only.",
        "",
        "| run | workers | median step s | tokens/s |",
        "|---|---|---|---|",
        f"| sharded (--shard), all workers | 4 | {sharded['median_step_s']:.3f} | {sharded['tokens_per_s']:,.0f} |",
        f"| unsharded, the workers the state fits | 1 (speed {speeds[3]:g}) | {fits_alone['median_step_s']:.3f} | "
        f"{fits_alone['tokens_per_s']:,.0f} |",
        f"| unsharded, all workers (as if the state fitted) | 4 | {unsharded['median_step_s']:.3f} | "
        f"{unsharded['tokens_per_s']:,.0f} |",
        "",
        f"Sharded on all workers against unsharded where it fits: "
        f"**{sharded['tokens_per_s'] / fits_alone['tokens_per_s']:.2f}x** "
        f"the tokens/s. Sharded step against the unsharded step on the same 4 workers: "
        f"**{sharded['median_step_s'] / unsharded['median_step_s']:.3f}x** (target at most 1.15x).",
        "",
        f"Gradient exchange, {gradient_bytes:,} bytes of gradient, ranges {wire['sizes']} elements, median of 5:",
        "",
        "| exchange | seconds | bytes sent per rank (loopback / 4) | vs a ring all-reduce's 2(N-1)/N x S |",
        "|---|---|---|---|",
    ]
    for name in ("all-reduce", "reduces onto owners + broadcasts"):
        row = wire[name]
        lines.append(f"| {name} | {row['median_s']:.4f} | {row['bytes_per_rank']:,.0f} | "
                     f"{row['bytes_per_rank'] / ring:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, "shard", text, {"sharded": sharded, "unsharded_alone": fits_alone,
                                                "unsharded_all": unsharded, "exchange": wire, "speeds": speeds,
                                                "state_memory": memory, "elements": elements})


if __name__ == "__main__":
    main()
