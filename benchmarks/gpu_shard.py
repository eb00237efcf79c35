"""Sharded optimizer state on a GPU, with cards of smaller memory emulated by
torch.cuda.set_per_process_memory_fraction (one process per emulated card):

  1. one emulated 11 GB card (NCCL, one rank): the unsharded 16-bit GPT (fp32 masters,
     their gradients, AdamW's moments on the card) against the sharded one (the same
     card owns the whole range: masters and moments, no fp32 gradient): the state bytes
     each allocates, the step time of each (median of a few steps), the largest GPT-2 of
     the presets that trains in each, and what the memory probe reports against what is
     free once the model, its gradients and a micro-batch's activations are in;
  2. with --four-ranks, four ranks on the one GPU (NCCL), emulating 11/11/11/32 GB cards:
     gpt2-774m, whose unsharded state (16.4 GiB) fits none of the 11 GB cards, trained
     sharded with the ranges the probe sizes. NCCL 2.28.9 refused several ranks on one
     device ("Duplicate GPU detected"), so this waits for four GPUs.

The H200 is not a legacy card: these figures check the sharded path on CUDA and its
memory accounting, not a legacy cluster's speed.

    python benchmarks/gpu_shard.py --out /tmp/gc          # shard_<gpu>.md/.json
"""

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from result_files import add_out_arguments, gpu_tag, write_results

from hetcomm.loop import BalancedLoop
from hetcomm.shard import Shard, ShardedAdamW
from hetcomm.loop.launch import free_port
from hetcomm.train.model import GPT, GPTConfig

GB = 10**9
# What NCCL 2.28.9 (torch 2.11, H200) answered on 2026-12-04 to four ranks on one GPU.
FOUR_RANKS_REFUSED = ("NCCL refuses several ranks on one GPU (NCCL 2.28.9 on 2026-12-04: 'ncclInvalidUsage: "
                      "Duplicate GPU detected : rank 2 and rank 0 both on CUDA device'); four cards are needed, "
                      "or --four-ranks to try again")
SEQ = 1024
SHAPES = {"gpt2-124m": (12, 12, 768), "gpt2-350m": (24, 16, 1024), "gpt2-774m": (36, 20, 1280),
          "gpt2-1.5b": (48, 25, 1600)}


class RandomWindows(torch.utils.data.Dataset):
    def __init__(self, size=4096):
        self.tokens = torch.randint(0, 50257, (size, SEQ + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def make_model(name: str, device) -> GPT:
    layers, heads, width = SHAPES[name]
    with torch.device(device):
        model = GPT(GPTConfig(vocab_size=50257, block_size=SEQ, n_layer=layers, n_head=heads, n_embd=width))
    return model.half()


def train(name: str, sharded: bool, world: int, rank: int, steps: int, split) -> dict:
    """Steps of the 16-bit GPT at micro-batch 1 on this rank's emulated card."""
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)   # what an earlier case left (nothing, after collect())
    torch.manual_seed(0)   # every rank builds the same weights
    model = make_model(name, device)
    masters = None if sharded else [p.detach().float().clone() for p in model.parameters()]

    def loss_of(batch):
        inputs, targets = batch
        return model(inputs, targets, reduction="sum")[1]

    loop = BalancedLoop(model, RandomWindows(), global_batch=sum(split), split=split, memory_caps=[1] * world,
                        precision="fp16", wire_dtype=torch.float16, items_per_sample=SEQ, master_params=masters,
                        shard=Shard() if sharded else None, probe_forward=loss_of, timeout=timedelta(seconds=90))
    if sharded:
        optimizer = ShardedAdamW(model.parameters(), loop.reducer, lr=1e-4)
    else:
        from hetcomm.optim import AdamW
        optimizer = AdamW(masters, lr=1e-4, copies=list(model.parameters()))
    seconds = []
    for step in loop.steps(steps):
        start = time.perf_counter()
        for batch in step:
            with loop.autocast():
                loss = loss_of(batch)
            step.backward(loss, reduction="sum")
        result = step.reduce()
        if not result.skipped:
            optimizer.step(grad_scale=result.clip_coefficient(1.0))
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    state = optimizer.state_bytes() if sharded else sum(
        t.numel() * t.element_size() for t in masters + [m.grad for m in masters if m.grad is not None]
        + [v for s in optimizer.state.values() for k, v in s.items() if k != "step"])
    return {"model": name, "sharded": sharded, "rank": rank, "elements": sum(p.numel() for p in model.parameters()),
            "state_bytes": state, "range": list(loop.reducer.range) if sharded else None,
            "step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0],
            "peak_allocated": torch.cuda.max_memory_allocated(device) - before, "left_before": before,
            "last_loss": result.loss}


def rank_main(rank, world, port, card_gb, cases, out):
    torch.cuda.set_device(0)
    torch.cuda.set_per_process_memory_fraction(card_gb[rank] * GB / torch.cuda.get_device_properties(0).total_memory)
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=90), device_id=torch.device("cuda", 0))
    results = []
    for name, sharded, steps in cases:
        try:
            results.append(train(name, sharded, world, rank, steps, [1] * world))
        except torch.OutOfMemoryError as error:
            results.append({"model": name, "sharded": sharded, "rank": rank,
                            "error": "out of memory: " + str(error).splitlines()[0][:160]})
        except Exception as error:  # reported, not raised: the next case still runs
            results.append({"model": name, "sharded": sharded, "rank": rank, "error": repr(error)[:300],
                            "traceback": traceback.format_exc()[-2000:]})
        # The loop's gradient hooks and the model form reference cycles: collect them, or the
        # next case would start with this one's tensors still allocated.
        gc.collect()
        torch.cuda.empty_cache()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_world(card_gb, cases, deadline_s: float) -> list[list[dict]] | str:
    """Every rank's results, or why there are none; ranks still running at the deadline
    (a collective that never completes) are killed."""
    world = len(card_gb)
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(rank_main, args=(world, free_port(), card_gb, cases, out), nprocs=world,
                                     start_method="spawn", join=False)
        end = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=max(1.0, end - time.monotonic())):
                if time.monotonic() >= end:
                    for process in context.processes:
                        process.kill()
                    return f"killed after {deadline_s:g} s (a rank never finished)"
        except Exception as error:
            return f"{type(error).__name__}: {str(error)[-600:]}"
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--four-ranks", action="store_true", help="try the four ranks on one GPU (NCCL refuses)")
    add_out_arguments(parser)
    args = parser.parse_args()
    name = torch.cuda.get_device_name(0)
    # One process per case: what a case leaves allocated (the loop's hooks and NCCL's work
    # objects hold tensors past gc.collect()) would shrink the next one's card.
    one = []
    for model in ("gpt2-124m", "gpt2-350m", "gpt2-774m"):
        for sharded in (False, True):
            found = run_world([11], [(model, sharded, args.steps)], deadline_s=150)
            one.append(found[0][0] if isinstance(found, list) else {"model": model, "sharded": sharded,
                                                                      "error": found})
    one = [one]
    four = run_world([11, 11, 11, 32], [("gpt2-774m", True, args.steps)], deadline_s=180) if args.four_ranks \
        else FOUR_RANKS_REFUSED
    lines = [f"Sharded state on {name} (sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}; NOT a legacy "
             f"card: correctness and memory accounting of the CUDA path), torch {torch.__version__}, fp16 weights, "
             f"fp16 wire, micro-batch 1 x {SEQ} tokens, {args.steps} steps (median step past the first).", ""]
    lines += ["## One emulated 11 GB card (NCCL, one rank)", "",
              "| model | state | state bytes | peak allocated GB | step s | result |", "|---|---|---|---|---|---|"]
    for row in one[0]:
        kind = "sharded" if row["sharded"] else "unsharded (fp32 masters)"
        if "error" in row:
            lines.append(f"| {row['model']} | {kind} | | | | {row['error']} |")
        else:
            lines.append(f"| {row['model']} | {kind} | {row['state_bytes']:,} | {row['peak_allocated'] / GB:.2f} | "
                         f"{row['step_s']:.3f} | loss {row['last_loss']:.3f} |")
    lines += ["", "## Four ranks on the one GPU, emulating 11/11/11/32 GB cards (NCCL)", ""]
    if isinstance(four, str):
        lines.append(f"not run: {four}")
    else:
        lines += ["| rank | card GB | range | state bytes | peak allocated GB | step s | result |",
                  "|---|---|---|---|---|---|---|"]
        for rank, rows in enumerate(four):
            for row in rows:
                if "error" in row:
                    lines.append(f"| {rank} | {[11, 11, 11, 32][rank]} | | | | | {row['error']} |")
                else:
                    lines.append(f"| {rank} | {[11, 11, 11, 32][rank]} | {row['range']} | {row['state_bytes']:,} | "
                                 f"{row['peak_allocated'] / GB:.2f} | {row['step_s']:.3f} | loss "
                                 f"{row['last_loss']:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        write_results(args.out, "shard", text, {"one_card": one, "four_ranks": four}, machine=gpu_tag(name))


if __name__ == "__main__":
    main()
