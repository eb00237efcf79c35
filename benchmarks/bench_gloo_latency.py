"""What one collective costs the trainer's simulated cluster: 4 Gloo processes on this
machine (127.0.0.1), timed as the benchmark cluster's step sees them. The figures behind
the reducer's bucket rule without overlap (a gradient within the cap goes as one
all-reduce) and behind the trainer gathering its per-step statistics in the weight
agreement instead of an all-reduce of their own.

    python benchmarks/bench_gloo_latency.py             # ~20 s
    python benchmarks/bench_gloo_latency.py --ranks 2
    python benchmarks/bench_gloo_latency.py --out benchmarks/results   # gloo_latency_cpu.md/.json

Rows (median over 31 rounds of rank 0's time, a barrier before each round):
  small all-reduce          8 float64 (an agreement, a gathered statistic)
  gradient, one bucket      the benchmark model's 0.95M fp16 gradient in one all-reduce
  gradient, 1 MB + rest     the same in two all-reduces launched at once (the small first bucket)
  broadcast of the split    4 int64 from rank 0
"""

import argparse
import os
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetcomm.train.launch import free_port
from result_files import add_out_arguments, write_results

ROUNDS = 31
GRADIENT_ELEMENTS = 950_000          # GPT 2x192 with the byte vocabulary
FIRST_BUCKET_ELEMENTS = 2**20 // 4   # 1 MB of fp32 gradient


def timed(run) -> float:
    times = []
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def all_reduce_all(tensors) -> None:
    for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
        work.wait()


def worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    small = torch.zeros(8, dtype=torch.float64)
    whole = torch.zeros(GRADIENT_ELEMENTS, dtype=torch.float16)
    parts = [torch.zeros(FIRST_BUCKET_ELEMENTS, dtype=torch.float16),
             torch.zeros(GRADIENT_ELEMENTS - FIRST_BUCKET_ELEMENTS, dtype=torch.float16)]
    split = torch.zeros(4, dtype=torch.int64)
    for tensors in ([small], [whole], parts):   # warm-up: connections, buffers
        for _ in range(5):
            all_reduce_all(tensors)
    rows = {"small all-reduce": timed(lambda: dist.all_reduce(small)),
            "gradient, one bucket": timed(lambda: all_reduce_all([whole])),
            "gradient, 1 MB + rest": timed(lambda: all_reduce_all(parts)),
            "broadcast of the split": timed(lambda: dist.broadcast(split, 0))}
    if rank == 0:
        results.update(rows)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    add_out_arguments(parser)
    args = parser.parse_args()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args.ranks, free_port(), results), nprocs=args.ranks)
        rows = dict(results)
    lines = [f"{args.ranks} Gloo processes on one {os.cpu_count()}-core machine, measured "
             f"{datetime.now(timezone.utc):%Y-%m-%d}, torch {torch.__version__}; median of {ROUNDS} rounds\n",
             "| collective | ms |", "|---|---|"]
    lines += [f"| {name} | {1e3 * seconds:.2f} |" for name, seconds in rows.items()]
    print("\n".join(lines))
    if args.out:
        write_results(args.out, "gloo_latency", "\n".join(lines), {"ranks": args.ranks, "seconds": rows},
                      variant=None if args.ranks == 4 else f"{args.ranks}ranks")


if __name__ == "__main__":
    main()
