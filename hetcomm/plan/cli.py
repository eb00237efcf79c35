"""`hetcomm plan`: the split, precision, memory fit and speed of a mixed GPU cluster,
predicted before it is bought or booked."""

import argparse
import json
import sys
import time

from hetcomm.plan.calibrate import RunProfile, load_run_profile
from hetcomm.plan.catalog import Catalog, load_catalog
from hetcomm.plan.cluster import parse_cluster
from hetcomm.plan.full_shard import CHECKPOINTING, HOST_MEMORY_GIB, OFFLOADS, parse_host_memory
from hetcomm.plan.hf_config import MODEL_TYPES, resolve_model
from hetcomm.plan.llama_shape import LLAMA_PRESETS
from hetcomm.plan.model_shape import ATTENTIONS, BERT_POSITIONS, GELUS, PRESETS
from hetcomm.plan.planner import WIRE_BYTES, Plan, make_plan, spec_members
from hetcomm.plan.precision import parse_precision
from hetcomm.plan.report import largest_lines, plan_dict, plan_text, simulation_dict, simulation_text
from hetcomm.plan.simulate import simulate
from hetcomm.simulated import parse_slowdown

DEFAULTS = {"model": "gpt2-124m", "global_batch": 512, "seq": 1024, "net": "10gbe", "intra": "pcie3"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hetcomm plan", description=__doc__,
        epilog="examples:\n"
               "  hetcomm plan --cluster \"2x1080ti,1xv100,4xt4\" --net 10gbe --model gpt2-124m --global-batch 512 "
               "--seq 1024\n"
               "  hetcomm plan --cluster \"4xt4+2xv100,8x1080ti\" --simulate 200 --slowdown 1:100:0.5\n"
               "  hetcomm plan --profile runs/latest            (the run's own cluster, from its measurements)\n"
               "  hetcomm plan --list-devices",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("the cluster")
    what.add_argument("--cluster", help="machines separated by commas, card groups in a machine joined by +, "
                                        "e.g. \"2x1080ti+1xv100,4xt4\"")
    what.add_argument("--net", help=f"link between machines: a name from --list-devices, or a figure such as "
                                    f"25Gbit/s or 3GB/s@20us (default {DEFAULTS['net']})")
    what.add_argument("--intra", help=f"link inside a machine (default {DEFAULTS['intra']})")
    what.add_argument("--devices", action="append", default=[], metavar="FILE",
                      help="a CSV of more GPUs or links (same columns as the built-in ones); repeatable")
    job = p.add_argument_group("the job")
    job.add_argument("--model", help=f"{', '.join(PRESETS)}; layers=L,heads=H,dim=D[,vocab=V]; or a Hugging Face "
                                     f"config.json (or its directory) of a {', '.join(MODEL_TYPES)} model "
                                     f"(default {DEFAULTS['model']})")
    job.add_argument("--global-batch", type=int,
                     help=f"sequences per optimizer step (default {DEFAULTS['global_batch']})")
    job.add_argument("--seq", type=int,
                     help=f"tokens per sequence (default {DEFAULTS['seq']}; {BERT_POSITIONS} for bert-*)")
    job.add_argument("--wire", choices=tuple(WIRE_BYTES), default="fp16", help="all-reduce dtype (default fp16)")
    job.add_argument("--precision", default="auto",
                     help="auto (per card, as hetcomm train: fp16 before sm_80, bf16 from it), fp32, tf32, fp16 or "
                          "bf16 for every card, or per kind of card: v100=fp16,1080ti=fp32 (a bare value sets the "
                          "others)")
    job.add_argument("--attention", choices=ATTENTIONS,
                     help="fused: scaled_dot_product_attention, scores never stored (hetcomm train, the default for "
                          "GPT models); eager: softmax(QK^T)V in separate kernels, seq x seq scores stored per head "
                          "(BERT-era code, HetSeq's included: the default for bert-* models)")
    job.add_argument("--gelu", choices=GELUS, default="fused",
                     help="fused: torch's F.gelu, one kernel (the default); composite: x*0.5*(1+erf(x/sqrt(2))) in "
                          "elementwise ops, as BERT's code had it before transformers 2.x, which keeps two more "
                          "4h-wide tensors per layer for backward (memory only; the step time counts one kernel)")
    job.add_argument("--shard", nargs="?", const="state", choices=("state", "full"),
                     help="state (a bare --shard): the optimizer state (fp32 masters, AdamW's moments) sharded by "
                          "each card's memory, as hetcomm train --shard keeps it: every card in, and the largest GPT-2 "
                          "and BERT that fit with and without; full: the weights, gradients and state too (ZeRO-3 "
                          "style), each layer unit's weights gathered before its forward and backward, with "
                          "activation checkpointing decided per card (hetcomm/plan/full_shard.py)")
    job.add_argument("--offload", choices=OFFLOADS,
                     help="optimizer: with --shard full, each rank's masters and moments in pinned host memory, "
                          "stepped by the CPU (host memory per machine and PCIe time are planned)")
    job.add_argument("--checkpointing", choices=CHECKPOINTING,
                     help="with --shard full: activation checkpointing per transformer block; auto (the default): on "
                          "for a card whose samples do not fit one micro-batch without it, off elsewhere")
    job.add_argument("--host-memory", metavar="GIB",
                     help=f"with --offload optimizer: each machine's RAM in GiB, one figure for all or one per machine "
                          f"(default {HOST_MEMORY_GIB:g})")
    job.add_argument("--overlap", action="store_true", help="buckets all-reduced during backward "
                                                            "(WeightedReducer overlap=True)")
    model = p.add_argument_group("the model of speed and memory")
    model.add_argument("--memory-fraction", type=float, default=0.9, help="share of each card's memory to plan "
                                                                          "with (default 0.9)")
    model.add_argument("--efficiency", type=float,
                       help="share of peak FLOP/s the matmuls reach, for every card (default: fitted per "
                            "architecture and math to published training runs, efficiency.csv; memory-bound work is "
                            "costed apart)")
    model.add_argument("--profile", metavar="RUN_DIR", help="a `hetcomm train` run: plan its cluster from its "
                                                            "measurements, or calibrate the --cluster's cards by it")
    model.add_argument("--profile-steps", metavar="FIRST:LAST", help="the run's steps to use (default 1: to the end)")
    sim = p.add_argument_group("simulation")
    sim.add_argument("--simulate", type=int, metavar="STEPS", help="step the plan through STEPS iterations with "
                                                                    "the trainer's rebalancer")
    sim.add_argument("--noise", type=float, default=0.05, help="relative spread of step times (default 0.05)")
    sim.add_argument("--slowdown", action="append", default=[], metavar="RANK:STEP:FACTOR",
                     help="a card that slows down mid-run, e.g. 2:100:0.5; repeatable")
    sim.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--list-devices", action="store_true", help="the known GPUs and links, then exit")
    return p


def _steps(text: str | None) -> tuple[int, int | None]:
    if text is None:
        return 1, None
    first, _, last = text.partition(":")
    try:
        return int(first or 1), int(last) if last else None
    except ValueError:
        raise ValueError(f"--profile-steps {text!r}: expected FIRST:LAST step numbers such as 5:40") from None


def _check_numbers(args) -> None:
    for name in ("global_batch", "seq", "simulate"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: expected a positive integer")
    if not (0 < args.memory_fraction <= 1):
        raise ValueError(f"--memory-fraction {args.memory_fraction}: expected a share in (0, 1]")
    if args.efficiency is not None and not (0 < args.efficiency <= 1):
        raise ValueError(f"--efficiency {args.efficiency}: expected a share of peak in (0, 1]")


def _check_sharding(args) -> None:
    """The options of --shard full, each refused with one line where it means nothing."""
    if args.offload and args.shard != "full":
        raise ValueError(f"--offload {args.offload} needs --shard full (the optimizer state offloaded to the host is "
                         f"planned for full sharding only)")
    if args.checkpointing and args.shard != "full":
        raise ValueError(f"--checkpointing {args.checkpointing} needs --shard full (activation checkpointing is "
                         f"planned for full sharding only)")
    if args.simulate and args.shard == "full":
        raise ValueError("--simulate steps the plan with the all-reduce trainer's rebalancer; it does not model "
                         "--shard full's lock-step micro-steps")
    if args.host_memory is not None and not args.offload:
        raise ValueError(f"--host-memory {args.host_memory} only counts with --offload optimizer")


def _shard_options(args, machines: int) -> dict:
    return {"shard": args.shard or False, "offload": args.offload, "checkpointing": args.checkpointing,
            "host_memory": parse_host_memory(args.host_memory, machines)}


def build_plan(args, catalog: Catalog) -> tuple[Plan, RunProfile | None]:
    _check_numbers(args)
    _check_sharding(args)
    profile = load_run_profile(args.profile, *_steps(args.profile_steps)) if args.profile else None
    if args.cluster is None and profile is None:
        raise ValueError("nothing to plan: give --cluster (e.g. --cluster \"2x1080ti,1xv100,4xt4\") or --profile "
                         "RUN_DIR; --list-devices shows the known cards")
    from_run = profile is not None and args.cluster is None
    model = resolve_model(args.model) if args.model else (profile.model if from_run
                                                           else resolve_model(DEFAULTS["model"]))
    seq = args.seq or (profile.seq if from_run else BERT_POSITIONS if model.kind == "bert" else DEFAULTS["seq"])
    if model.max_seq is not None and seq > model.max_seq:
        held = "rotary positions up to max_position_embeddings =" if model.kind == "llama" else \
            "position embeddings for"
        raise ValueError(f"--seq {seq}: {model.name} has {held} {model.max_seq} tokens")
    global_batch = args.global_batch or (profile.global_batch if from_run else DEFAULTS["global_batch"])
    measured = profile.link if from_run else None
    in_node = catalog.link(args.intra) if args.intra else (measured or catalog.link(DEFAULTS["intra"]))
    between = catalog.link(args.net) if args.net else (measured or catalog.link(DEFAULTS["net"]))
    if from_run:
        if args.model or args.seq:
            raise ValueError("--model and --seq change what the run measured; with --profile alone the plan is the "
                             "run's own model (add --cluster to plan other cards with its calibration)")
        members = profile.members()
    else:
        cluster = parse_cluster(args.cluster, catalog)
        efficiency = profile.efficiencies(catalog) if profile else {}
        if args.efficiency is not None:
            efficiency = {entry.device.name: args.efficiency for entry in cluster}
        precision = parse_precision(args.precision, catalog, [entry.device for entry in cluster])
        members = spec_members(cluster, model, seq, precision=precision, wire=args.wire,
                               memory_fraction=args.memory_fraction, efficiency=efficiency,
                               attention=args.attention or ("eager" if model.kind == "bert" else "fused"),
                               gelu=args.gelu)
    plan = make_plan(members, model, seq, global_batch, in_node=in_node, between_nodes=between, wire=args.wire,
                     overlap=args.overlap, memory_fraction=args.memory_fraction,
                     **_shard_options(args, max(m.node for m in members) + 1))
    return plan, profile


def largest_models(args, catalog: Catalog, seq: int, global_batch: int) -> dict[str, dict[str, str | None]]:
    """The largest GPT-2 and BERT presets that the --cluster trains at this --seq (BERT's
    capped at its positions) and global batch, on all its cards and on some, with the
    optimizer state sharded and not; with --shard full also fully sharded, with and
    without the optimizer state offloaded, and the Llama-3.2 family besides."""
    cluster = parse_cluster(args.cluster, catalog)
    precision = parse_precision(args.precision, catalog, [entry.device for entry in cluster])
    modes: list[tuple[str, dict]] = [("", {}), ("_sharded", {"shard": "state"})]
    families = [("GPT-2", "gpt2-"), ("BERT", "bert-")]
    if args.shard == "full":
        full = {"shard": "full", "checkpointing": args.checkpointing,
                "host_memory": parse_host_memory(args.host_memory, max(e.node for e in cluster) + 1)}
        modes += [("_full", full), ("_offload", {**full, "offload": "optimizer"})]
        families.append(("Llama-3.2", "llama-3.2-"))
    found: dict[str, dict[str, str | None]] = {}
    for family, prefix in families:
        found[family] = {where + suffix: None for suffix, _ in modes for where in ("all", "any")}
        presets = LLAMA_PRESETS if family == "Llama-3.2" else PRESETS
        shapes = sorted((s for n, s in presets.items() if n.startswith(prefix) and not n.endswith("-qa")),
                        key=lambda s: s.parameters(seq))
        for shape in shapes:
            length = min(seq, BERT_POSITIONS) if shape.kind == "bert" else seq
            members = spec_members(cluster, shape, length, precision=precision, wire=args.wire,
                                   memory_fraction=args.memory_fraction,
                                   attention="fused" if shape.kind == "llama" else
                                   args.attention or ("eager" if shape.kind == "bert" else "fused"),
                                   gelu="fused" if shape.kind == "llama" else args.gelu)
            for suffix, options in modes:
                try:
                    plan = make_plan(members, shape, length, max(global_batch, len(members)), in_node=catalog.link(
                        args.intra or DEFAULTS["intra"]), between_nodes=catalog.link(args.net or DEFAULTS["net"]),
                                     wire=args.wire, find_slow_cards=False, memory_fraction=args.memory_fraction,
                                     **options)
                except ValueError:
                    continue
                found[family]["any" + suffix] = shape.name
                if len(plan.members) == len(members):
                    found[family]["all" + suffix] = shape.name
    return found


def _what_fits(args, error: Exception) -> str:
    """After a sharded plan that does not fit: the largest presets that do, if any."""
    if not (args.shard and args.cluster and "does not fit" in str(error)):
        return ""
    try:
        catalog = load_catalog(args.devices)
        shape = resolve_model(args.model or DEFAULTS["model"])
        seq = args.seq or (BERT_POSITIONS if shape.kind == "bert" else DEFAULTS["seq"])
        largest = largest_models(args, catalog, seq, args.global_batch or DEFAULTS["global_batch"])
    except ValueError:
        return ""
    cards = len(parse_cluster(args.cluster, catalog))
    return "what fits instead:\n" + "\n".join(largest_lines(largest, cards, seq, args.global_batch
                                                            or DEFAULTS["global_batch"])) + "\n"


def list_devices(catalog: Catalog) -> str:
    lines = [f"{'name':<14} {'label':<28} {'CC':>4} {'fp32':>6} {'fp16':>6} {'bf16':>6} {'GiB':>5} {'GB/s':>6}"]
    for device in sorted(catalog.devices.values(), key=lambda d: (d.capability, d.name)):
        bf16 = f"{device.bf16_tflops:6.1f}" if device.bf16_tflops else "     -"
        lines.append(f"{device.name:<14} {device.label[:28]:<28} {device.capability[0]}.{device.capability[1]:<2} "
                     f"{device.fp32_tflops:6.1f} {device.fp16_tflops:6.1f} {bf16} {device.memory_gib:5.0f} "
                     f"{device.bandwidth_gbs:6.0f}")
    lines.append("\nTFLOPS are public peak figures; fp16 is the tensor-core rate with fp32 accumulate where there are "
                 "tensor cores (without them, fp16 matmuls run at the fp32 rate).\n")
    lines.append(f"{'link':<14} {'label':<40} {'scope':<8} {'GB/s':>7} {'latency':>8}")
    for link in sorted(catalog.links.values(), key=lambda k: (k.scope, k.bandwidth_gbs)):
        lines.append(f"{link.name:<14} {link.label[:40]:<40} {link.scope:<8} {link.bandwidth_gbs:7.2f} "
                     f"{link.latency_us:6.0f}us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        catalog = load_catalog(args.devices)
        if args.list_devices:
            print(list_devices(catalog))
            return 0
        slowdowns = tuple(parse_slowdown(text, 10**9) for text in args.slowdown)
        if slowdowns and args.simulate is None:
            raise ValueError("--slowdown only acts in a simulation: add --simulate STEPS")
        start = time.perf_counter()
        plan, profile = build_plan(args, catalog)
        seconds = time.perf_counter() - start
        simulation = simulate(plan, args.simulate, noise=args.noise, slowdowns=slowdowns, seed=args.seed) \
            if args.simulate else None
        largest = largest_models(args, catalog, plan.seq, plan.global_batch) if args.shard and args.cluster else None
    except (ValueError, FileNotFoundError) as error:
        parser().exit(2, f"hetcomm plan: error: {error}\n" + _what_fits(args, error))
    if args.json:
        record = plan_dict(plan)
        record["planning_seconds"] = seconds
        if profile:
            record["profile"] = str(profile.path)
        if simulation:
            record["simulation"] = simulation_dict(simulation)
        if largest:
            record["largest"] = largest
        json.dump(record, sys.stdout, indent=1, allow_nan=False)
        print()
        return 0
    print(plan_text(plan, profile, seconds, largest))
    if simulation:
        print()
        print(simulation_text(simulation, plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
