"""Per-step gradient synchronisation on Gloo ranks (processes on 127.0.0.1, CPU): the
routes a DDP or HetSeq user has today against hetcomm's weighted reduction, timed in
the same run on the same gradients (a ~25M-parameter GPT's gradient list).

    python benchmarks/bench_allreduce.py                 # 2 and 4 ranks over plain loopback
    python benchmarks/bench_allreduce.py --link-gbit 1   # each rank behind a simulated 1 Gbit/s link
    python benchmarks/bench_allreduce.py --ranks 2 --json out.json
    python benchmarks/bench_allreduce.py --link-gbit 1 --out benchmarks/results   # allreduce_1gbit_cpu.md/.json

Plain loopback moves bytes at memory speed, so there the reduction arithmetic, not the
wire, dominates. --link-gbit R (root, Linux tc) shapes the loopback device to R x ranks
Gbit/s in all for the length of the run (a token bucket), i.e. R Gbit/s per rank as
when every machine has an R Gbit Ethernet port into a switch: the regime hetcomm is
built for. The shaping is removed when the run ends.

Routes (each rank holds a different share n_i/N of the global batch):
  ddp-allreduce+weighting  DDP's default hook (divide by world, fp32 all-reduce) on 25 MB buckets,
                           after the pass that weights each rank's gradient by n_i/N * world
  ddp-fp16-compress        DDP's fp16_compress_hook (cast, divide, fp16 all-reduce, cast back);
                           unweighted: it cannot express n_i/N
  hetseq                   DDP average, then HetSeq's rescale: an all-reduce of the sample count
                           and a pass multiplying every gradient by world/N * n_i
  hetcomm-fp32 / -fp16     WeightedReducer.reduce: weight agreement, pack with the weight fused in,
                           all-reduce, unpack with unscale, overflow check and norm fused in

Time per sync is the slowest rank's median over the timed rounds; each round times every
route once (interleaved), and the last column is the median over rounds of a route's time
over hetcomm-fp16's in the same round. Wire bytes per rank
follow the ring all-reduce, 2(N-1)/N * S for an S-byte buffer; algbw = S/t and busbw =
algbw * 2(N-1)/N (nccl-tests' definitions). The lower bound is the ring's bytes over the
per-rank bandwidth measured in the same run while every rank sends to its ring
neighbour at once.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import hetcomm
from hetcomm.train.launch import free_port
from result_files import add_out_arguments, write_results

COUNTS = [3, 7, 1, 13]
# DDP's bucket sizes (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_mb=25).
DDP_FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20
WARMUP, STEPS = 2, 15


def gpt_shapes(n_layer=6, d=512, vocab=8192, block=1024):
    shapes = [(vocab, d), (block, d)]
    for _ in range(n_layer):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


class Bucket:
    """The part of dist.GradBucket that DDP's built-in hooks read."""

    def __init__(self, buffer, index):
        self._buffer, self._index = buffer, index

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index


def ddp_buckets(total):
    """DDP's flat fp32 bucket buffers, 1 MB first then 25 MB (as with
    gradient_as_bucket_view=True: no copy into the buckets, DDP's fastest setting)."""
    bounds = [0, min(total, DDP_FIRST_BUCKET_BYTES // 4)]
    while bounds[-1] < total:
        bounds.append(min(total, bounds[-1] + BUCKET_BYTES // 4))
    return [Bucket(torch.randn(end - start), i) for i, (start, end) in enumerate(zip(bounds, bounds[1:]))]


def run_hook(hook, buckets):
    for future in [hook(None, b) for b in buckets]:
        future.wait()


def route_functions(params, weight, world):
    buckets = ddp_buckets(sum(p.numel() for p in params))
    reducer32 = hetcomm.WeightedReducer(params, wire_dtype=torch.float32)
    reducer16 = hetcomm.WeightedReducer(params, wire_dtype=torch.float16)
    count = torch.tensor([weight])

    def ddp_weighted():
        torch._foreach_mul_([b.buffer() for b in buckets], weight * world)
        run_hook(default_hooks.allreduce_hook, buckets)

    def hetseq():
        run_hook(default_hooks.allreduce_hook, buckets)
        dist.all_reduce(count)
        torch._foreach_mul_([b.buffer() for b in buckets], world * weight)

    return {
        "ddp-allreduce+weighting": (ddp_weighted, 4),
        "ddp-fp16-compress": (lambda: run_hook(default_hooks.fp16_compress_hook, buckets), 2),
        "hetseq": (hetseq, 4),
        "hetcomm-fp32": (lambda: reducer32.reduce(weight=weight), 4),
        "hetcomm-fp16": (lambda: reducer16.reduce(weight=weight, loss_scale=1024.0), 2),
    }


def interleaved_times(routes: dict) -> dict[str, list[float]]:
    """Each route's time per round, the slowest rank's: every round times every route
    once, so a drift of the shared machine's speed reaches all routes alike and the
    routes can be compared round by round."""
    times = {name: [] for name in routes}
    for step in range(WARMUP + STEPS):
        for name, fn in routes.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= WARMUP:
                times[name].append(elapsed.item())
    return times


def ring_link_bandwidth(rank, world, elements):
    """Bytes per second each rank sends while every rank sends to its ring neighbour at
    once (the traffic pattern of a ring all-reduce); median of 5, slowest rank."""
    send, recv = torch.zeros(elements), torch.empty(elements)
    times = []
    for _ in range(6):
        dist.barrier()
        start = time.perf_counter()
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return elements * 4 / statistics.median(times[1:])


def rank_main(rank, world, port, out_path):
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    counts = COUNTS[:world]
    weight = counts[rank] / sum(counts)
    generator = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.empty(s)) for s in gpt_shapes()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    numel = sum(p.numel() for p in params)
    link = ring_link_bandwidth(rank, world, numel // 4)
    rows = []
    routes = route_functions(params, weight, world)
    times = interleaved_times({name: fn for name, (fn, _) in routes.items()})
    for name, (_, wire_bytes_per_element) in routes.items():
        seconds = statistics.median(times[name])
        # Round by round against hetcomm's fp16 wire: the ratio the machine's drift cancels from.
        paired = statistics.median(t / h for t, h in zip(times[name], times["hetcomm-fp16"]))
        size = numel * wire_bytes_per_element
        ring = 2 * (world - 1) / world
        rows.append({"route": name, "ranks": world, "parameters": numel, "seconds": seconds,
                     "paired_ratio_to_hetcomm_fp16": paired,
                     "wire_bytes_per_rank": ring * size, "algbw_GBps": size / seconds / 1e9,
                     "busbw_GBps": size / seconds * ring / 1e9,
                     "lower_bound_seconds": ring * size / link, "link_GBps": link / 1e9})
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def shaped_loopback(total_gbit: float | None):
    """Limits the loopback device to `total_gbit` Gbit/s for the duration (tc tbf)."""
    if total_gbit is None:
        yield
        return
    current = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True).stdout
    if "noqueue" not in current:
        raise SystemExit(f"the loopback device already has a queueing discipline ({current.strip()}); not touching it")
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{total_gbit}gbit", "burst", "1mb",
                    "latency", "500ms"], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=True)


def run(world, link_gbit):
    out = Path(f"/tmp/hetcomm-bench-allreduce-{os.getpid()}-{world}.json")
    with shaped_loopback(None if link_gbit is None else link_gbit * world):
        mp.start_processes(rank_main, args=(world, free_port(), str(out)), nprocs=world, join=True,
                           start_method="spawn")
    rows = json.loads(out.read_text())
    out.unlink()
    for row in rows:
        row["link"] = "loopback" if link_gbit is None else f"{link_gbit:g} Gbit/s per rank (simulated)"
    return rows


def table(rows):
    lines = [f"Link: {rows[0]['link']}.\n",
             "| ranks | route | ms per sync | wire MB per rank | algbw GB/s | busbw GB/s | × ring lower bound | "
             "time / hetcomm-fp16 (median of per-round ratios) |", "|---|---|---|---|---|---|---|---|"]
    for world in sorted({r["ranks"] for r in rows}):
        group = [r for r in rows if r["ranks"] == world]
        for r in group:
            lines.append(f"| {world} | {r['route']} | {r['seconds'] * 1e3:.1f} | "
                         f"{r['wire_bytes_per_rank'] / 1e6:.1f} | {r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} | "
                         f"{r['seconds'] / r['lower_bound_seconds']:.1f} | {r['paired_ratio_to_hetcomm_fp16']:.3f}x |")
    links = ", ".join(f"{w} ranks: {next(r['link_GBps'] for r in rows if r['ranks'] == w):.2f} GB/s"
                      for w in sorted({r["ranks"] for r in rows}))
    return "\n".join(lines) + (f"\n\nPer-rank bandwidth with every rank sending to its ring neighbour, same run: "
                               f"{links}.")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--link-gbit", type=float, help="simulate a link of this many Gbit/s per rank (root, tc)")
    parser.add_argument("--json", help="also write the rows here")
    add_out_arguments(parser)
    args = parser.parse_args()
    if any(w < 2 or w > len(COUNTS) for w in args.ranks):
        parser.error(f"--ranks must be between 2 and {len(COUNTS)}")
    if args.link_gbit is not None and args.link_gbit <= 0:
        parser.error("--link-gbit must be positive")
    rows = [row for world in args.ranks for row in run(world, args.link_gbit)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    text = (f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on {os.cpu_count()} CPU cores, Gloo over loopback, "
            f"torch {torch.__version__}, {rows[0]['parameters'] / 1e6:.1f}M fp32 gradients in {len(gpt_shapes())} "
            f"tensors, batches {COUNTS}; median of {STEPS} interleaved rounds after {WARMUP} warm-up, slowest rank.\n\n"
            + table(rows))
    print(text)
    if args.out:
        variant = "loopback" if args.link_gbit is None else f"{args.link_gbit:g}gbit"
        write_results(args.out, "allreduce", text, rows, variant=variant)


if __name__ == "__main__":
    main()
