"""Full sharding on a GPU against the planner: one rank (NCCL) on one emulated legacy card.

For each case (gpt2-774m at seq 1024, a Llama-3.2-1B-shaped model at seq 1024 and 2048):
  1. the plan of `hetcomm plan --cluster 1x<card> --shard full --offload optimizer` for
     that card: its micro-batch, its checkpointing and the bytes it holds;
  2. a run as `hetcomm train --shard full --offload optimizer` builds it: 16-bit weights,
     BalancedLoop(shard=Shard(weights=True, offload="optimizer")), ShardedAdamW with its
     fp32 masters and moments in pinned host memory, the planned micro-batch and
     checkpointing (the loss in chunks where it is on), two micro-steps a step, the card's
     usable memory less the CUDA context as the allocator's cap
     (torch.cuda.set_per_process_memory_fraction);
  3. torch.cuda.max_memory_allocated over the steps against the plan's bytes less the
     CUDA context (the allocator counts tensors only). Target: within 10%.

One rank owns every element, so its range is the whole model (6 B an element offloaded):
what a card of a four-card job holds differs only in the range's size, which the CPU
tests check against the same accounting. The H200 is not a legacy card: these figures
check the accounting of the CUDA path, not a legacy card's speed.

    python benchmarks/gpu_full_shard.py --out /tmp/gc      # full_shard_memory_<gpu>.md/.json
    python benchmarks/gpu_full_shard.py --device cpu --tiny      # the code path, on CPU
"""

import argparse
import gc
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from result_files import add_out_arguments, gpu_tag, write_results

from hetcomm.loop import BalancedLoop
from hetcomm.loop.launch import free_port
from hetcomm.plan import load_catalog, parse_cluster
from hetcomm.plan.cost import CONTEXT_BYTES
from hetcomm.plan.llama_shape import LLAMA_PRESETS, LlamaShape
from hetcomm.plan.model_shape import PRESETS, ModelShape
from hetcomm.plan.planner import make_plan, spec_members
from hetcomm.shard import Shard, ShardedAdamW
from hetcomm.train.llama import Llama, LlamaConfig
from hetcomm.train.model import GPT, GPTConfig

TARGET = 0.10
PLAN_BATCH = 8   # the global batch the card is planned for: the plan's micro-batch is what counts


@dataclass(frozen=True)
class Case:
    model: str
    seq: int


CASES = (Case("gpt2-774m", 1024), Case("llama-3.2-1b", 1024), Case("llama-3.2-1b", 2048))
TINY = (Case("tiny-gpt", 64), Case("tiny-llama", 64))


def shape_of(name: str):
    if name == "tiny-gpt":
        return ModelShape("tiny-gpt", n_layer=2, n_head=2, n_embd=64, vocab_size=512)
    if name == "tiny-llama":
        return LlamaShape("tiny-llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16, intermediate=128,
                          vocab_size=512, tied=True, max_positions=1024)
    return LLAMA_PRESETS[name] if name in LLAMA_PRESETS else PRESETS[name]


def card_plan(case: Case, card: str):
    """The plan's member and full-shard card for one `card` running `case` alone."""
    catalog = load_catalog()
    shape = shape_of(case.model)
    members = spec_members(parse_cluster(f"1x{card}", catalog), shape, case.seq)
    plan = make_plan(members, shape, case.seq, PLAN_BATCH, in_node=catalog.link("pcie3"),
                     between_nodes=catalog.link("10gbe"), shard="full", offload="optimizer")
    return plan.members[0], plan.full.cards[0]


def build_model(case: Case):
    """The model hetcomm train builds for the shape, in fp32 on the host."""
    shape = shape_of(case.model)
    if isinstance(shape, LlamaShape):
        return Llama(LlamaConfig(vocab_size=shape.vocab_size, block_size=case.seq, n_layer=shape.n_layer,
                                 n_head=shape.n_head, n_kv_head=shape.n_kv_head, n_embd=shape.n_embd,
                                 head_dim=shape.head_dim, intermediate=shape.intermediate,
                                 tie_embeddings=shape.tied))
    return GPT(GPTConfig(vocab_size=shape.vocab_size, block_size=case.seq, n_layer=shape.n_layer,
                         n_head=shape.n_head, n_embd=shape.n_embd))


class RandomWindows(torch.utils.data.Dataset):
    def __init__(self, vocab: int, seq: int, size: int = 64):
        self.tokens = torch.randint(0, vocab, (size, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def run_case(case: Case, card: str, device: torch.device, steps: int) -> dict:
    """The planned card's micro-batch and checkpointing, trained for `steps` steps."""
    member, planned = card_plan(case, card)
    torch.manual_seed(0)
    model = build_model(case)
    masters = [p.detach().clone() for p in model.parameters()]   # fp32, on the host until the owners take them
    # fp16 as the planned card computes (hetcomm.amp's policy before sm_80); bf16 on CPU.
    precision = "fp16" if device.type == "cuda" else "bf16"
    model = model.to(getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])).to(device)
    model.checkpointing = planned.checkpointing
    micro = planned.micro_batch
    loop = BalancedLoop(model, RandomWindows(model.config.vocab_size, case.seq), global_batch=2 * micro,
                        split=[2 * micro], memory_caps=[micro], precision=precision,
                        wire_dtype=torch.float16, items_per_sample=case.seq, seed=0,
                        timeout=timedelta(seconds=120),
                        shard=Shard(memory=[int(planned.free_bytes)], weights=True, offload="optimizer"))
    by_id = {id(p): m for p, m in zip(model.parameters(), masters)}
    optimizer = ShardedAdamW(list(model.parameters()), loop.reducer, lr=1e-4, betas=(0.9, 0.95),
                             initial_masters=[by_id[id(p)] for p in loop.flat.params], offload=True)
    del masters, by_id
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    seconds, losses = [], []
    for step in loop.steps(steps):
        start = time.perf_counter()
        for inputs, targets in step:
            with loop.autocast():
                loss = model(inputs, targets, reduction="sum")[1]
            step.backward(loss, reduction="sum")
        result = step.reduce()
        if not result.skipped:
            optimizer.step(grad_scale=result.clip_coefficient(1.0))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(result.loss)
    row = {"model": case.model, "seq": case.seq, "card": member.label, "micro_batch": micro,
           "checkpointing": planned.checkpointing, "elements": planned.elements,
           "planned_bytes": planned.held_bytes - planned.context_bytes, "losses": losses, "step_s": seconds,
           "host_bytes": optimizer.host_bytes()}
    if device.type == "cuda":
        row["before_bytes"] = before
        row["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        row["ratio"] = row["peak_allocated"] / row["planned_bytes"]
    return row


def run_cases(cases, card: str, device_type: str, steps: int) -> list[dict]:
    """This process as the one rank: every case in turn, each reported whatever the others do."""
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120), **({"device_id": device} if device.type == "cuda" else {}))
    rows = []
    for case in cases:
        if device.type == "cuda":
            usable = card_plan(case, card)[0].cost.memory_bytes - CONTEXT_BYTES
            torch.cuda.set_per_process_memory_fraction(usable / torch.cuda.get_device_properties(device).total_memory)
        try:
            rows.append(run_case(case, card, device, steps))
        except torch.OutOfMemoryError as error:
            rows.append({"model": case.model, "seq": case.seq, "error": "out of memory: " + str(error)[:200]})
        except Exception as error:  # reported, not raised: the next case still runs
            rows.append({"model": case.model, "seq": case.seq, "error": repr(error)[:300],
                         "traceback": traceback.format_exc()[-2000:]})
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return rows


def table(rows, device_name: str, card: str, steps: int) -> str:
    lines = [f"Full sharding with the optimizer offloaded, one rank on {device_name} emulating one {card} "
             f"(its usable memory less the CUDA context as the allocator's cap), torch {torch.__version__}, "
             f"{steps} steps of two micro-steps; planned bytes from `hetcomm plan --cluster 1x{card} --shard full "
             f"--offload optimizer`, less the context. Not a legacy card: the memory accounting of the CUDA path.", "",
             "| model | seq | micro | ckpt | planned GB | peak allocated GB | peak / planned | within 10% | losses |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['seq']} | | | | | | no | {row['error']} |")
            continue
        peak = row.get("peak_allocated")
        measured = f"{peak / 1e9:.2f}" if peak is not None else "(not on a GPU)"
        ratio = f"{row['ratio']:.3f}" if peak is not None else ""
        met = ("yes" if abs(row["ratio"] - 1) <= TARGET else "no") if peak is not None else ""
        lines.append(f"| {row['model']} | {row['seq']} | {row['micro_batch']} | "
                     f"{'on' if row['checkpointing'] else 'off'} | {row['planned_bytes'] / 1e9:.2f} | {measured} | "
                     f"{ratio} | {met} | {', '.join(f'{x:.3f}' for x in row['losses'])} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--card", default="1080ti", help="the catalog's card to emulate (default 1080ti)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models: the code path, not the figures")
    add_out_arguments(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (--device cpu --tiny runs the code path)")
    rows = run_cases(TINY if args.tiny else CASES, args.card, args.device, args.steps)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    text = table(rows, name, args.card, args.steps)
    print(text)
    if args.out:
        write_results(args.out, "full_shard_memory", text, rows,
                      machine=gpu_tag(name) if args.device == "cuda" else "cpu")


if __name__ == "__main__":
    main()
