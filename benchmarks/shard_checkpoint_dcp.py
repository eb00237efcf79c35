"""Whether hetcomm's sharded checkpoints should be torch.distributed.checkpoint (DCP),
measured, same run, against hetcomm.shard.checkpoint's own files:

(a) DCP's default planner given each rank's range as a plain tensor under one key
    (4 Gloo ranks, uneven 11/11/11/32 ranges of one 1-D fp32 state): what it saves;
(b) DCP given the same tensors marked with its chunk hooks (the CheckpointableTensor
    protocol: global_shape, global_offsets, local_offsets, local_sizes): whether it
    saves every range and reads them back on 3 ranks of another uneven split (a card
    removed: 11/11/32), bit for bit;
(c) seconds to save (4 ranks) and to reshard-load (3 ranks), and bytes on disk, of (b)
    and of hetcomm.shard.checkpoint;
(d) what each reader does with a flipped byte in a data file, and whether reading a
    checkpoint's metadata can run code (DCP's .metadata is a pickle).

Every element's float32 bits are its index, so any misplaced element shows.

    python benchmarks/shard_checkpoint_dcp.py --out benchmarks/results   # shard_checkpoint_dcp_cpu.md
"""

import argparse
import json
import pathlib
import pickle
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from result_files import add_out_arguments, write_results

from hetcomm.loop.checkpoint import CheckpointError
from hetcomm.loop.launch import free_port
from hetcomm.shard.checkpoint import load_range, save_range

KEY = "exp_avg"
MODEL = "model"


def bounds_of(total: int, shares: list[int]) -> list[int]:
    edges, acc = [0], 0
    for share in shares[:-1]:
        acc += share
        edges.append(total * acc // sum(shares))
    return edges + [total]


def values(start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the state: each element's bits are its index."""
    return torch.arange(start, stop, dtype=torch.int32).view(torch.float32)


def hooked(tensor: torch.Tensor, start: int, total: int) -> torch.Tensor:
    """A plain tensor marked as the range [start, start + numel) of a (total,) tensor."""
    tensor.global_shape = (total,)
    tensor.global_offsets = ((start,),)
    tensor.local_offsets = ((0,),)
    tensor.local_sizes = ((tensor.numel(),),)
    return tensor


def timed(fn, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    return seconds


def spread(seconds: list[float]) -> str:
    """The median of the repeats, with their range when there are several."""
    ordered = sorted(seconds)
    median = ordered[len(ordered) // 2]
    return f"{median:.2f}" if len(ordered) == 1 else f"{median:.2f} ({ordered[0]:.2f}-{ordered[-1]:.2f})"


def save_main(rank: int, world: int, port: int, work: str, bounds: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    start, stop, total = bounds[rank], bounds[rank + 1], bounds[-1]
    mine = values(start, stop)
    times = {
        "dcp_plain_save_s": timed(lambda: dcp.save({KEY: mine}, checkpoint_id=f"{work}/dcp_plain"), repeats),
        "dcp_hooks_save_s": timed(lambda: dcp.save({KEY: hooked(mine.clone(), start, total)},
                                                   checkpoint_id=f"{work}/dcp_hooks"), repeats),
        "own_save_s": timed(lambda: save_range(Path(work, "own"), 1, rank, world, start, stop, total, MODEL,
                                               {KEY: mine}), repeats),
    }
    if rank == 0:
        Path(work, "save.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def load_main(rank: int, world: int, port: int, work: str, bounds: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    start, stop, total = bounds[rank], bounds[rank + 1], bounds[-1]
    expected = values(start, stop).view(torch.int32)
    got = {}

    def dcp_load():
        got["dcp"] = hooked(torch.zeros(stop - start), start, total)
        dcp.load({KEY: got["dcp"]}, checkpoint_id=f"{work}/dcp_hooks")

    def own_load():
        got["own"] = load_range(Path(work, "own"), 1, start, stop, total, MODEL)[KEY]

    result = {"dcp_hooks_load_s": timed(dcp_load, repeats), "own_load_s": timed(own_load, repeats)}
    for engine in ("dcp", "own"):
        result[f"{engine}_wrong"] = int((got[engine].view(torch.int32) != expected).sum())
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(work, "load.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x40]))


class _Touch:
    """Unpickling this creates a file: what any code in a pickle could do instead."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def integrity(work: str, total: int) -> dict:
    """One process: a flipped byte in the largest data file of each engine, then the
    whole state read back; and a .metadata that runs code when read."""
    found = {}
    biggest = max(Path(work, "dcp_hooks").glob("*.distcp"), key=lambda p: p.stat().st_size)
    flip_a_byte(biggest)
    whole = hooked(torch.zeros(total), 0, total)
    try:
        dcp.load({KEY: whole}, checkpoint_id=f"{work}/dcp_hooks", no_dist=True)
        wrong = int((whole.view(torch.int32) != values(0, total).view(torch.int32)).sum())
        found["dcp_flipped"] = f"read without an error, {wrong:,} element(s) wrong"
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        found["dcp_flipped"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:160]}"
    del whole
    own_file = max(Path(work, "own").glob("*.pt"), key=lambda p: p.stat().st_size)
    flip_a_byte(own_file)
    try:
        load_range(Path(work, "own"), 1, 0, total, total, MODEL)
        found["own_flipped"] = "read without an error"
    except CheckpointError as error:
        found["own_flipped"] = "CheckpointError: " + str(error).replace(str(Path(work, "own")) + "/", "")[:160]
    # A checkpoint is data from elsewhere: can reading it run code?
    foreign = Path(work, "foreign")
    foreign.mkdir()
    marker = Path(work, "code-ran")
    (foreign / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    try:
        dcp.FileSystemReader(str(foreign)).read_metadata()
    except Exception:
        pass   # the object is not Metadata; the code already ran
    found["dcp_metadata_runs_code"] = marker.exists()
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total", type=int, default=100_000_000, help="fp32 elements in all (default 100M)")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads of each engine (default 3)")
    add_out_arguments(parser)
    args = parser.parse_args()
    total = args.total
    save_bounds, load_bounds = bounds_of(total, [11, 11, 11, 32]), bounds_of(total, [11, 11, 32])
    with tempfile.TemporaryDirectory() as work:
        mp.start_processes(save_main, args=(4, free_port(), work, save_bounds, args.repeats), nprocs=4,
                           start_method="spawn")
        mp.start_processes(load_main, args=(3, free_port(), work, load_bounds, args.repeats), nprocs=3,
                           start_method="spawn")
        save = json.loads(Path(work, "save.json").read_text())
        load = json.loads(Path(work, "load.json").read_text())
        size = {name: sum(p.stat().st_size for p in Path(work, name).iterdir())
                for name in ("dcp_plain", "dcp_hooks", "own")}
        files = {name: len(list(Path(work, name).iterdir())) for name in size}
        plain_md = dcp.FileSystemReader(f"{work}/dcp_plain").read_metadata().state_dict_metadata[KEY]
        hooks_md = dcp.FileSystemReader(f"{work}/dcp_hooks").read_metadata().state_dict_metadata[KEY]
        plain_whole = torch.zeros(total)
        try:
            dcp.load({KEY: plain_whole}, checkpoint_id=f"{work}/dcp_plain", no_dist=True)
            plain_read = "read without an error"
        except BaseException as error:  # what DCP says is the finding (a BaseException)
            plain_read = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:140]}"
        del plain_whole
        faults = integrity(work, total)
    dcp_wrong = sum(r["dcp_wrong"] for r in load)
    own_wrong = sum(r["own_wrong"] for r in load)
    # A reshard-load's seconds: the slowest rank's, each repeat (the barriers make them about equal).
    load_dcp = [max(r["dcp_hooks_load_s"][i] for r in load) for i in range(args.repeats)]
    load_own = [max(r["own_load_s"][i] for r in load) for i in range(args.repeats)]
    share = [b - a for a, b in zip(save_bounds, save_bounds[1:])]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on the shared 2-core host, torch {torch.__version__}: one 1-D fp32 "
        f"state of {total:,} elements ({total * 4 / 1e6:,.0f} MB), saved by 4 Gloo CPU ranks holding uneven "
        f"11/11/11/32 ranges ({', '.join(f'{n:,}' for n in share)}), then read back by 3 ranks of another uneven "
        f"split (11/11/32, a card removed). Seconds between barriers, median (range) of {args.repeats} repeats, "
        f"same run; files fsynced by both engines.", "",
        "| engine | what it recorded | files | bytes on disk | save s (4 ranks) | reshard-load s (3 ranks) | "
        "read back |", "|---|---|---|---|---|---|---|",
        f"| DCP, default planner, plain tensors | one tensor of shape {tuple(plain_md.size)}, "
        f"{len(plain_md.chunks)} chunk | {files['dcp_plain']} | {size['dcp_plain']:,} | "
        f"{spread(save['dcp_plain_save_s'])} | - | whole on one process: {plain_read} |",
        f"| DCP, chunk hooks (CheckpointableTensor) | shape {tuple(hooks_md.size)}, {len(hooks_md.chunks)} chunks | "
        f"{files['dcp_hooks']} | {size['dcp_hooks']:,} | {spread(save['dcp_hooks_save_s'])} | {spread(load_dcp)} | "
        f"{total - dcp_wrong:,} of {total:,} elements right |",
        f"| hetcomm.shard.checkpoint | 4 ranges tiling [0, {total:,}), with digests | {files['own']} | "
        f"{size['own']:,} | {spread(save['own_save_s'])} | {spread(load_own)} | {total - own_wrong:,} of {total:,} "
        f"elements right |", "",
        "Integrity, same files, one process reading the whole state:", "",
        "| fault | DCP (chunk hooks) | hetcomm.shard.checkpoint |", "|---|---|---|",
        f"| one byte flipped mid-file in the largest data file | {faults['dcp_flipped']} | {faults['own_flipped']} |",
        f"| a .metadata / range file whose unpickling runs code | FileSystemReader.read_metadata ran it: "
        f"{faults['dcp_metadata_runs_code']} (pickle.load) | read with torch.load(weights_only=True): cannot |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, "shard_checkpoint_dcp", text,
                      {"total": total, "save_bounds": save_bounds, "load_bounds": load_bounds, "save": save,
                       "load": load, "bytes": size, "files": files, "dcp_plain_shape": list(plain_md.size),
                       "dcp_plain_read": plain_read, "faults": faults})


if __name__ == "__main__":
    main()
