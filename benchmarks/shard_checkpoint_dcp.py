"""Why hetcomm's sharded checkpoints are not torch.distributed.checkpoint (DCP): what
DCP's default planner does with the uneven ranges of sharded optimizer state, each rank
holding its range as a plain tensor under one key (4 Gloo ranks, ranges in 11/11/11/32
parts of 4M fp32 elements), against hetcomm.shard.checkpoint, same run: what comes back
on one process asking for the whole, and the seconds to save.

    python benchmarks/shard_checkpoint_dcp.py --out benchmarks/results   # shard_checkpoint_dcp_cpu.md
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException
from result_files import add_out_arguments, write_results

from hetcomm.loop.launch import free_port
from hetcomm.shard.checkpoint import load_range, save_range

TOTAL = 4_000_000
BOUNDS = [0, 676_923, 1_353_846, 2_030_769, TOTAL]   # 11/11/11/32 parts


def full_state() -> torch.Tensor:
    return torch.arange(TOTAL, dtype=torch.float32)


def rank_main(rank: int, world: int, port: int, work: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mine = full_state()[BOUNDS[rank]:BOUNDS[rank + 1]].clone()
    times = {}
    dist.barrier()
    start = time.perf_counter()
    dcp.save({"exp_avg": mine}, checkpoint_id=str(Path(work) / "dcp"))
    dist.barrier()
    times["dcp_save_s"] = time.perf_counter() - start
    start = time.perf_counter()
    save_range(Path(work) / "own", 1, rank, world, BOUNDS[rank], BOUNDS[rank + 1], TOTAL, "model", {"exp_avg": mine})
    dist.barrier()
    times["own_save_s"] = time.perf_counter() - start
    if rank == 0:
        Path(work, "times.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        mp.start_processes(rank_main, args=(4, free_port(), work), nprocs=4, start_method="spawn")
        times = json.loads(Path(work, "times.json").read_text())
        dcp_bytes = sum(p.stat().st_size for p in Path(work, "dcp").iterdir())
        own_bytes = sum(p.stat().st_size for p in Path(work, "own").iterdir())
        metadata = dcp.FileSystemReader(str(Path(work) / "dcp")).read_metadata()
        saved = metadata.state_dict_metadata["exp_avg"]
        whole = {"exp_avg": torch.zeros(TOTAL)}
        try:
            dcp.load(whole, checkpoint_id=str(Path(work) / "dcp"), no_dist=True)
            dcp_result = f"loaded without an error; {int((whole['exp_avg'] == full_state()).sum()):,} of {TOTAL:,} " \
                         f"elements right"
        except (Exception, CheckpointException) as error:  # what DCP says is the finding (its error is a BaseException)
            dcp_result = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
        own = load_range(Path(work) / "own", 1, 0, TOTAL, TOTAL, "model")["exp_avg"]
        own_result = f"{int((own == full_state()).sum()):,} of {TOTAL:,} elements right"
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on the shared 2-core host, torch {torch.__version__}: 4 Gloo ranks, "
        f"each holding its range of one 1-D fp32 state ({TOTAL:,} elements in 11/11/11/32 parts) as a plain tensor "
        f"under one key, saved by each engine, then read whole on one process.", "",
        "| engine | what it recorded for the key | bytes on disk | save s | read back whole |", "|---|---|---|---|---|",
        f"| torch.distributed.checkpoint, default planner | a tensor of shape {tuple(saved.size)} | {dcp_bytes:,} | "
        f"{times['dcp_save_s']:.3f} | {dcp_result} |",
        f"| hetcomm.shard.checkpoint | 4 ranges tiling [0, {TOTAL:,}) | {own_bytes:,} | {times['own_save_s']:.3f} | "
        f"{own_result} |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, "shard_checkpoint_dcp", text, {"times": times, "dcp_bytes": dcp_bytes,
                                                                "own_bytes": own_bytes, "dcp": dcp_result,
                                                                "own": own_result})


if __name__ == "__main__":
    main()
