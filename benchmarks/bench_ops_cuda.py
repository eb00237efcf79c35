"""GPU benchmarks of hetcomm's CUDA kernels and of its Triton kernels (route "triton",
where triton is installed) against the best unfused PyTorch routes and the
device-to-device copy bandwidth measured in the same run.

    python benchmarks/bench_ops_cuda.py --out gpu-results --label native

For each op, total size (1M, 16M, 256M elements) and list length (~100 and 1,000
tensors of uneven sizes): CUDA-event times of every route, median with 20th/80th
percentiles, over several input sets used in turn so that no timed call finds its
data in L2 from the previous one; bytes the op must move per second; the ratio to the
same-run copy bandwidth and to the best unfused route; and the kernel launches of one
call (torch.profiler). Writes ops_cuda_<label>.json and .csv under --out. Run by
benchmarks/gpu_check.sh, which also builds and tests; not a pytest module.
"""

import argparse
import csv
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType

import hetcomm

ops = torch.ops.hetcomm
# hetcomm's own implementations; every other route is an unfused PyTorch one.
FUSED = ("hetcomm", "triton")


def triton_ops():
    """torch.ops.hetcomm_triton, or None where triton cannot be imported."""
    try:
        import hetcomm.triton  # noqa: F401  (registers the ops)
    except ImportError:
        return None
    return torch.ops.hetcomm_triton
SIZES = {"1M": 2**20, "16M": 16 * 2**20, "256M": 256 * 2**20}
TENSOR_COUNTS = (100, 1000)
# Bytes per element that each op must move: every input read once, every output written once.
# adamw_: the fp16 gradient read, the fp32 master and both moments read and written, the bf16 copy written.
BYTES = {"pack": 4 + 2, "unpack_": 2 + 4, "unscale_": 4 + 4, "cast_": 4 + 2, "adamw_": 2 + 12 + 12 + 2, "copy": 4 + 4}
# Bytes per element of each op's input: the launch target is one launch per 64 MB of it.
INPUT_BYTES = {"pack": 4, "unpack_": 2, "unscale_": 4, "cast_": 4, "adamw_": 14}
ADAMW_HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def tensor_sizes(total: int, count: int) -> list[int]:
    """Uneven sizes (like a model's parameters) that add up to exactly `total`."""
    weights = [1 + (i * 7919) % 13 for i in range(count)]
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


class InputSet:
    """One copy of every buffer the routes of all ops use, for one size and list length."""

    def __init__(self, sizes: list[int], seed: int):
        total = sum(sizes)
        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.grads = [torch.randn(n, device="cuda", generator=generator) for n in sizes]
        self.out32 = [torch.empty(n, device="cuda") for n in sizes]
        self.out16 = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
        self.wire = torch.empty(total, device="cuda", dtype=torch.float16)
        self.wire.copy_(torch.cat(self.grads))
        self.wire_views = list(self.wire.split(sizes))
        self.flat32 = torch.empty(total, device="cuda")
        self.copy_dst = torch.empty(total, device="cuda")
        self.scale = torch.full((1,), 0.25, device="cuda")
        self.scale_0d = self.scale.view(())  # the form torch._foreach_mul takes
        self.one = torch.ones(1, device="cuda")  # unscale_ by 1 keeps repeated runs finite
        self.found_inf = torch.zeros(1, device="cuda")
        self.sq_norm = torch.zeros(1, device="cuda")
        # adamw_: fp32 masters and moments, fp16 gradients (the wire's), a device step count.
        self.masters = [g.clone() for g in self.grads]
        self.exp_avgs = [g * 0.1 for g in self.grads]
        self.exp_avg_sqs = [g * g * 1e-2 for g in self.grads]
        self.grads16 = [g.half() for g in self.grads]
        self.steps = [torch.tensor(10.0, device="cuda") for _ in sizes]
        self.step = torch.full((1,), 10.0, device="cuda")
        self.inv_scale = torch.full((1,), 4.0, device="cuda")


def routes(op: str) -> dict:
    """name -> function(InputSet) for hetcomm (CUDA C++, and Triton where installed) and
    the unfused PyTorch routes of `op`."""
    triton = triton_ops()
    if triton is not None and op in ("pack", "unpack_", "unscale_"):
        fused = {"pack": lambda s: triton.pack.out(s.grads, s.scale, out=s.wire),
                 "unpack_": lambda s: triton.unpack_(s.wire, s.out32, s.scale, s.found_inf, s.sq_norm),
                 "unscale_": lambda s: triton.unscale_(s.grads, s.one, s.found_inf)}[op]
        return {"triton": fused, **cuda_and_unfused_routes(op)}
    return cuda_and_unfused_routes(op)


def cuda_and_unfused_routes(op: str) -> dict:
    if op == "pack":
        return {
            "hetcomm": lambda s: ops.pack.out(s.grads, s.scale, out=s.wire),
            "cat+mul_+copy_": lambda s: s.wire.copy_(torch.cat(s.grads, out=s.flat32).mul_(s.scale)),
            "foreach_mul+foreach_copy_": lambda s: torch._foreach_copy_(s.wire_views,
                                                                        torch._foreach_mul(s.grads, s.scale_0d)),
        }
    if op == "unpack_":
        def foreach_route(s):
            torch._foreach_copy_(s.out32, s.wire_views)
            torch._amp_foreach_non_finite_check_and_unscale_(s.out32, s.found_inf, s.scale)
            s.sq_norm.add_(torch.stack(torch._foreach_norm(s.out32)).square().sum())

        def flat_route(s):
            torch.mul(s.wire, s.scale, out=s.flat32)
            s.found_inf.copy_(torch.maximum(s.found_inf, (~torch.isfinite(s.flat32)).any().float()))
            s.sq_norm.add_(torch.linalg.vector_norm(s.flat32).square())
            torch._foreach_copy_(s.out32, list(s.flat32.split([t.numel() for t in s.out32])))

        return {
            "hetcomm": lambda s: ops.unpack_(s.wire, s.out32, s.scale, s.found_inf, s.sq_norm),
            "foreach_copy_+unscale+norm": foreach_route,
            "mul+isfinite+norm+foreach_copy_": flat_route,
        }
    if op == "unscale_":
        return {
            "hetcomm": lambda s: ops.unscale_(s.grads, s.one, s.found_inf),
            "_amp_foreach_non_finite_check_and_unscale_":
                lambda s: torch._amp_foreach_non_finite_check_and_unscale_(s.grads, s.found_inf, s.one),
        }
    if op == "cast_":
        return {
            "hetcomm": lambda s: ops.cast_(s.grads, s.out16),
            "_foreach_copy_": lambda s: torch._foreach_copy_(s.out16, s.grads),
        }
    if op == "adamw_":
        def unfused_route(s):
            torch._foreach_copy_(s.out32, s.grads16)
            torch._fused_adamw_(s.masters, s.out32, s.exp_avgs, s.exp_avg_sqs, [], s.steps, amsgrad=False,
                                maximize=False, grad_scale=s.inv_scale, found_inf=s.found_inf, **ADAMW_HYPER)
            torch._foreach_copy_(s.out16, s.masters)

        return {
            "hetcomm": lambda s: ops.adamw_(s.grads16, s.masters, s.exp_avgs, s.exp_avg_sqs, s.out16,
                                            grad_scale=s.scale, found_inf=s.found_inf, step=s.step, **ADAMW_HYPER),
            "foreach_copy_+_fused_adamw_+foreach_copy_": unfused_route,
        }
    if op == "copy":
        return {"copy_": lambda s: s.copy_dst.copy_(s.flat32)}
    raise ValueError(op)


def time_route(run, sets: list[InputSet], reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls, cycling through the input sets."""
    for s in sets:
        run(s)  # warm-up: caches of the allocator, the launcher and cuBLAS-free kernels
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        s = sets[r % len(sets)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(s)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def count_launches(run, s: InputSet) -> int:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(s)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA and "memcpy" not in e.name.lower()
               and "memset" not in e.name.lower())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
        return out.splitlines()[0].strip()
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def environment(label: str) -> dict:
    props = torch.cuda.get_device_properties(0)
    info = hetcomm.info()
    return {
        "label": label,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "l2_mib": round(props.L2_cache_size / 2**20, 1),
        "driver": driver_version(),
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "hetcomm": info["hetcomm"],
        "hetcomm_cuda_archs": info["backends"]["cuda"]["archs"],
        "python": platform.python_version(),
    }


def measure(total: int, count: int, reps: int, op_names: list[str]) -> list[dict]:
    sizes = tensor_sizes(total, count)
    set_bytes = total * 28  # the 20 bytes per element of an InputSet and the unfused routes' temporaries
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_sets = max(2, min(16, math.ceil(4 * l2 / set_bytes)))
    free = torch.cuda.mem_get_info()[0]
    n_sets = min(n_sets, max(1, int(0.8 * free // set_bytes)))  # the rows say how many were used
    sets = [InputSet(sizes, seed) for seed in range(n_sets)]
    copy_ms = statistics.median(time_route(routes("copy")["copy_"], sets, reps))
    copy_gbps = BYTES["copy"] * total / copy_ms / 1e6
    rows = []
    for op in op_names:
        results = {}
        for name, run in routes(op).items():
            times = time_route(run, sets, reps)
            results[name] = {"median_ms": statistics.median(times), "p20_ms": percentile(times, 0.2),
                             "p80_ms": percentile(times, 0.8), "launches": count_launches(run, sets[0])}
        unfused = {k: v for k, v in results.items() if k not in FUSED}
        best = min(unfused, key=lambda k: unfused[k]["median_ms"])
        for name, r in results.items():
            gbps = BYTES[op] * total / r["median_ms"] / 1e6
            rows.append({"op": op, "elements": total, "tensors": count, "route": name, **r,
                         "gbps": gbps, "copy_gbps": copy_gbps, "pct_of_copy": 100 * gbps / copy_gbps,
                         "best_unfused": best, "speedup_vs_best_unfused": results[best]["median_ms"] / r["median_ms"],
                         "input_sets": n_sets, "reps": reps})
    del sets
    torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> list[str]:
    """The issue's targets, checked for the hetcomm rows."""
    lines = []
    for r in rows:
        if r["route"] not in FUSED:
            continue
        allowed = math.ceil(r["elements"] * INPUT_BYTES[r["op"]] / 2**26) + 1
        notes = [f"{r['median_ms']:.3f} ms", f"{r['gbps']:.0f} GB/s", f"{r['pct_of_copy']:.0f}% of copy",
                 f"{r['speedup_vs_best_unfused']:.2f}x vs {r['best_unfused']}",
                 f"{r['launches']} launches (target <= {allowed})"]
        if r["op"] == "adamw_" and r["elements"] >= 16 * 2**20:
            notes.append("copy target " + ("met" if r["pct_of_copy"] >= 80 else "MISSED"))
        if r["op"] in ("pack", "unpack_"):
            if r["elements"] >= 256 * 2**20:
                notes.append("copy target " + ("met" if r["pct_of_copy"] >= 80 else "MISSED"))
            if r["elements"] >= 16 * 2**20:
                notes.append("2x target " + ("met" if r["speedup_vs_best_unfused"] >= 2 else "MISSED"))
        lines.append(f"{r['route']:7s} {r['op']:9s} {r['elements'] // 2**20:4d}M x {r['tensors']:4d}: "
                     + ", ".join(notes))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-results", help="directory for the JSON and CSV")
    parser.add_argument("--label", default="native", help="names this build in the results, e.g. native, ptx-7.5")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--tensors", nargs="+", type=int, default=list(TENSOR_COUNTS))
    parser.add_argument("--ops", nargs="+", default=["pack", "unpack_", "unscale_", "cast_", "adamw_"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible to torch", file=sys.stderr)
        return 1

    env = environment(args.label)
    print(json.dumps(env))
    rows = []
    for size_name in args.sizes:
        for count in args.tensors:
            total = SIZES[size_name]
            try:
                rows += measure(total, count, args.reps, args.ops)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"skipped {size_name} x {count}: out of GPU memory", file=sys.stderr)
                rows.append({"op": "*", "elements": total, "tensors": count, "route": "skipped: out of memory"})
            print(f"done {size_name} x {count}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"ops_cuda_{args.label}"
    lines = summary(rows)
    stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows, "summary": lines}, indent=1))
    fields = sorted({key for row in rows for key in row}, key=lambda k: (k not in ("op", "elements", "tensors",
                                                                                    "route"), k))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["label", "gpu"] + fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({"label": args.label, "gpu": env["gpu"], **row})
    print(f"[{args.label}] {env['gpu']} (sm_{env['capability'].replace('.', '')}), torch {env['torch']}, "
          f"CUDA {env['cuda_runtime']}, driver {env['driver']}")
    print("\n".join(lines))
    print(f"wrote {stem}.json and {stem}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
