"""Launch-shape sweep of hetcomm's CUDA kernels: per op and dtype pair, every launch
shape (blocks per SM x items per thread) checked against hetcomm.reference, then timed
against the same run's device-to-device copy of the same bytes.

    python benchmarks/sweep_launch.py --out "$OUT"                     # on a GPU
    python benchmarks/sweep_launch.py --emulator sm75 --out /tmp/sweep  # on the CPU emulator

On a GPU: 256M elements in 100 tensors of uneven sizes by default (far beyond any L2, so
no call finds its data left in L2 by the one before); per shape the CUDA-event median and
20th/80th percentiles of --reps calls; GB/s of the bytes the op must move (every input
read once, every output written once); the percentage of torch's copy_ of as many bytes,
timed in the same run just before the case; the ratio to the table's shape; and the grid
and registers per thread of the call's largest launch (from the profiler's trace). The
launcher caps blocks per SM at what an SM keeps resident of the kernel, so shapes above
the cap launch the cap's grid: the grid column shows where it is.

Shapes: the table's own (csrc/cuda/launch_shape.cu), then every --blocks x --items set
through torch.ops.hetcomm._set_launch_shape and cleared after each, also on error. Items
per thread apply to the multi-tensor kernel (pack, unpack_, cast_, unscale_); adamw_'s
kernel keeps one element per thread in flight and has no such parameter, so only its
blocks per SM are swept.

Every shape runs once and is checked before it is timed: its outputs bit for bit against
hetcomm.reference's (every one of these ops is bit-exact), found_inf exactly, and
unpack_'s sum of squares bit for bit against the table shape's (its rounding depends on
neither the items per thread nor the grid) and within its error bound of the reference's
float64 sum. A shape that computes wrong is reported "wrong" and never timed; a shape the
op refuses is reported "refused", with the op's message.

Chunk size is not swept. kChunk (csrc/kernels/launch_args.h, 8192 elements) is a
compile-time constant and stays one: it is the unit of unpack_'s sum-of-squares partials,
so it fixes that sum's rounding, which the kernels promise to be the same bits on every
GPU model of a mixed cluster; a chunk size chosen per device would break that promise.
Trying other values would take one nvcc build of the extension per value (minutes each),
more than a lent GPU's time; and a chunk's own bookkeeping (one binary search over at
most 160 table rows, for the norm one block reduction) is spread over 8192 elements.

--emulator sm61|sm75|sm80 runs the same sweep on tests/cuda_emulator's CPU emulator of
that GPU (CPU tensors; 160K elements in 10 tensors, blocks 1 and 2 per SM by default): it
checks every shape's result, and this script end to end, without a GPU. Its times are the
wall-clock times of a CPU that runs every CUDA thread as a fiber, meaningless for
bandwidth, and its results say so.

Writes sweep_launch_<gpu>.md and .json under --out (sweep_launch_emulated-<gpu>_cpu.* on
the emulator), naming the device. Exits with 1 if a shape computed wrong. Run by
benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_ops_cuda import environment, percentile, tensor_sizes
from result_files import gpu_tag, write_results

from hetcomm import reference

ROOT = Path(__file__).resolve().parents[1]
ops = torch.ops.hetcomm
ITEMS = (2, 4)  # the multi-tensor kernel's instances (with_items in csrc/cuda/multi_tensor_cuda.cu)
WARMUPS = 2
ADAMW_HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
# What the sweep runs at unless told otherwise, on a GPU and on the emulator.
GPU_DEFAULTS = {"elements": 256 * 2**20, "tensors": 100, "reps": 20}
EMULATOR_DEFAULTS = {"elements": 160 * 2**10, "tensors": 10, "reps": 3, "blocks": [1, 2]}


@dataclass(frozen=True)
class Case:
    """An op and its dtype pair: source -> destination; for unscale_ the tensors' dtype
    (in place); for adamw_ the gradients' -> the masters' copies'."""

    op: str
    src: torch.dtype
    dst: torch.dtype

    @property
    def name(self) -> str:
        return f"{self.op} {SHORT[self.src]}->{SHORT[self.dst]}"

    @property
    def has_items(self) -> bool:
        return self.op != "adamw_"

    @property
    def bytes_per_element(self) -> int:
        if self.op == "adamw_":  # the gradient and the copy; master and both moments read and written
            return self.src.itemsize + 24 + self.dst.itemsize
        return self.src.itemsize + self.dst.itemsize


CASES = [
    Case("pack", torch.float32, torch.float16), Case("pack", torch.float32, torch.bfloat16),
    Case("unpack_", torch.float16, torch.float32), Case("unpack_", torch.bfloat16, torch.float32),
    Case("cast_", torch.float32, torch.float16), Case("cast_", torch.float32, torch.bfloat16),
    Case("cast_", torch.float16, torch.float32),
    Case("unscale_", torch.float32, torch.float32),
    Case("adamw_", torch.float16, torch.float16), Case("adamw_", torch.float32, torch.bfloat16),
]


def random_list(sizes: list[int], dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    return [(torch.randn(n, generator=generator, device=device) * 4).to(dtype) for n in sizes]


def poison(tensors: list[torch.Tensor]) -> None:
    """Fills the tensors with NaN, so that an element a shape leaves unwritten shows."""
    for t in tensors:
        t.fill_(float("nan"))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


class Workload:
    """The tensors of one case: run() is one call of the op; reset() restores the inputs
    it works on in place, poisons its outputs and zeroes its flags; outputs() are what
    check() compares, bit for bit, with `expected`, the reference's outputs from the
    same inputs."""

    expected: list[torch.Tensor]
    sq_norm: torch.Tensor | None = None  # unpack_'s

    def run(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def outputs(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def for_timing(self) -> None:
        """Readies the inputs for repeated timed calls (after a check)."""


class Pack(Workload):
    def __init__(self, case: Case, sizes: list[int], device: str):
        self.src = random_list(sizes, case.src, device, seed=1)
        self.scale = torch.full((1,), 0.25, device=device)
        self.wire = torch.empty(sum(sizes), dtype=case.dst, device=device)
        self.expected = [reference.pack(self.src, self.scale, case.dst)]

    def run(self):
        ops.pack.out(self.src, self.scale, out=self.wire)

    def reset(self):
        poison([self.wire])

    def outputs(self):
        return [self.wire]


class Unpack(Workload):
    def __init__(self, case: Case, sizes: list[int], device: str):
        self.wire = random_list([sum(sizes)], case.src, device, seed=2)[0]
        self.dst = [torch.empty(n, dtype=case.dst, device=device) for n in sizes]
        self.scale = torch.full((1,), 0.5, device=device)
        self.found_inf = torch.zeros(1, device=device)
        self.sq_norm = torch.zeros(1, device=device)
        expected = [torch.empty_like(t) for t in self.dst]
        found_inf, self.reference_norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
        reference.unpack_(self.wire, expected, self.scale, found_inf, self.reference_norm)
        self.expected = [*expected, found_inf]

    def run(self):
        ops.unpack_(self.wire, self.dst, self.scale, self.found_inf, self.sq_norm)

    def reset(self):
        poison(self.dst)
        self.found_inf.zero_()
        self.sq_norm.zero_()

    def outputs(self):
        return [*self.dst, self.found_inf]


class Cast(Workload):
    def __init__(self, case: Case, sizes: list[int], device: str):
        self.src = random_list(sizes, case.src, device, seed=3)
        self.dst = [torch.empty(n, dtype=case.dst, device=device) for n in sizes]
        self.expected = [torch.empty_like(t) for t in self.dst]
        reference.cast_(self.src, self.expected)

    def run(self):
        ops.cast_(self.src, self.dst)

    def reset(self):
        poison(self.dst)

    def outputs(self):
        return self.dst


class Unscale(Workload):
    """In place: checked at an inverse scale of 0.5, so that an element a shape skips
    keeps its old value and shows; timed at 1, so that repeated calls keep the values."""

    def __init__(self, case: Case, sizes: list[int], device: str):
        self.original = random_list(sizes, case.src, device, seed=4)
        self.tensors = [t.clone() for t in self.original]
        self.inv_scale = torch.full((1,), 0.5, device=device)
        self.found_inf = torch.zeros(1, device=device)
        expected, found_inf = [t.clone() for t in self.original], torch.zeros(1, device=device)
        reference.unscale_(expected, self.inv_scale, found_inf)
        self.expected = [*expected, found_inf]

    def run(self):
        ops.unscale_(self.tensors, self.inv_scale, self.found_inf)

    def reset(self):
        for t, o in zip(self.tensors, self.original, strict=True):
            t.copy_(o)
        self.inv_scale.fill_(0.5)
        self.found_inf.zero_()

    def for_timing(self):
        self.inv_scale.fill_(1.0)

    def outputs(self):
        return [*self.tensors, self.found_inf]


class AdamW(Workload):
    def __init__(self, case: Case, sizes: list[int], device: str):
        self.grads = random_list(sizes, case.src, device, seed=5)
        masters = random_list(sizes, torch.float32, device, seed=6)
        exp_avgs = [t * 0.01 for t in random_list(sizes, torch.float32, device, seed=7)]
        self.original = [masters, exp_avgs, [t * t for t in exp_avgs]]
        self.state = [[t.clone() for t in tensors] for tensors in self.original]  # masters, both moments
        self.copies = [torch.empty(n, dtype=case.dst, device=device) for n in sizes]
        self.grad_scale = torch.full((1,), 0.5, device=device)
        self.found_inf = torch.zeros(1, device=device)  # stays 0: a non-zero one would skip every step
        self.step = torch.full((1,), 10.0, device=device)
        state = [[t.clone() for t in tensors] for tensors in self.original]
        copies = [torch.empty_like(t) for t in self.copies]
        reference.adamw_(self.grads, *state, copies, self.grad_scale, self.found_inf, self.step, **ADAMW_HYPER)
        self.expected = [t for tensors in state for t in tensors] + copies

    def run(self):
        ops.adamw_(self.grads, *self.state, self.copies, self.grad_scale, self.found_inf, self.step, **ADAMW_HYPER)

    def reset(self):
        for tensors, originals in zip(self.state, self.original, strict=True):
            for t, o in zip(tensors, originals, strict=True):
                t.copy_(o)
        poison(self.copies)

    def outputs(self):
        return [t for tensors in self.state for t in tensors] + self.copies


WORKLOADS = {"pack": Pack, "unpack_": Unpack, "cast_": Cast, "unscale_": Unscale, "adamw_": AdamW}


def sq_norm_rtol(n: int) -> float:
    """How far unpack_'s sq_norm of n values may be from the reference's, relative to the
    latter (Higham's bounds, as tests/tolerances.py counts them): the kernel sums squares
    in fp32 runs of up to 8 (7 roundings), then in float64, then rounds to fp32; the
    reference sums exact squares in float64 and rounds to fp32."""
    u32, u64 = 2.0**-24, 2.0**-53
    in_float64 = n * u64 / (1 - n * u64)
    theirs = (1 + in_float64) * (1 + u32) - 1
    ours = (1 + 7 * u32 / (1 - 7 * u32)) * (1 + theirs) - 1
    return (ours + theirs) / (1 - theirs)


@contextlib.contextmanager
def launch_shape(blocks_per_sm: int | None, items_per_thread: int):
    """The kernels launch with this shape while open; with blocks_per_sm None, with the
    table's. The override never outlives the block."""
    if blocks_per_sm is None:
        yield
        return
    ops._set_launch_shape(blocks_per_sm, items_per_thread)
    try:
        yield
    finally:
        ops._clear_launch_shape()


class Gpu:
    """The CUDA device 0: CUDA-event times, grids from the profiler's trace."""

    tensors = "cuda"

    def __init__(self):
        self.props = torch.cuda.get_device_properties(0)

    def describe(self) -> str:
        return f"{self.props.name} (sm_{self.props.major}{self.props.minor}, {self.props.multi_processor_count} SMs)"

    def environment(self) -> dict:
        return environment("sweep_launch")

    def result_name(self) -> dict:
        return {"machine": gpu_tag(self.props.name)}

    def default_blocks(self) -> list[int]:
        """1 up to what fills the SM's threads with 256-thread blocks."""
        return list(range(1, self.props.max_threads_per_multi_processor // 256 + 1))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def times_ms(self, run, reps: int) -> list[float]:
        for _ in range(WARMUPS):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times

    def largest_launch(self, run) -> dict:
        """The grid and registers per thread of the call's largest hetcomm kernel launch."""
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text()).get("traceEvents", [])
        launches = [e["args"] for e in events
                    if e.get("cat") == "kernel" and "hetcomm" in e.get("name", "") and "grid" in e.get("args", {})]
        if not launches:
            return {"grid": None, "registers": None}
        largest = max(launches, key=lambda a: a["grid"][0])
        return {"grid": largest["grid"][0], "registers": largest.get("registers per thread")}


class Emulator:
    """tests/cuda_emulator's GPU `name`, switched on for CPU tensors: wall-clock times,
    grids from the emulator's record of launches."""

    tensors = "cpu"

    def __init__(self, name: str):
        sys.path.insert(0, str(ROOT / "tests"))
        import cuda_emulator

        self.name = name
        self.spec = cuda_emulator.build.DEVICES[name]
        self.gpu = cuda_emulator.emulated_gpu(name)

    def describe(self) -> str:
        return (f"the CPU emulator's {self.name} ({self.spec.sm_count} SMs, {self.spec.max_threads_per_sm} threads "
                f"and at most {self.spec.resident_blocks} resident blocks per SM)")

    def environment(self) -> dict:
        return {"label": "sweep_launch", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "gpu": f"emulated {self.name}", "emulator": self.spec.__dict__,
                "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                "python": platform.python_version()}

    def result_name(self) -> dict:
        return {"variant": f"emulated-{self.name}", "machine": "cpu"}

    def default_blocks(self) -> list[int]:
        return EMULATOR_DEFAULTS["blocks"]

    def synchronize(self) -> None:
        pass

    def times_ms(self, run, reps: int) -> list[float]:
        for _ in range(WARMUPS):
            run()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
        return times

    def largest_launch(self, run) -> dict:
        self.gpu.take_recent_launches()
        run()
        return {"grid": max(launch.grid for launch in self.gpu.take_recent_launches()), "registers": None}


def check(device, workload: Workload, table_norm: torch.Tensor | None) -> str | None:
    """None when one call computes what the reference does, else what is wrong."""
    workload.reset()
    try:
        workload.run()
        device.synchronize()
    except RuntimeError as error:  # a launch the GPU (or the emulator) refused or failed
        return "raised " + str(error).splitlines()[0]
    outputs = workload.outputs()
    pairs = zip(outputs, workload.expected, strict=True)
    wrong = [i for i, (got, want) in enumerate(pairs) if not same_bits(got, want)]
    if wrong:
        return f"{len(wrong)} of {len(outputs)} outputs differ from the reference's (the first: output {wrong[0]})"
    if workload.sq_norm is not None:
        if table_norm is not None and not same_bits(workload.sq_norm, table_norm):
            return f"sq_norm {workload.sq_norm.item()!r} is not the table shape's {table_norm.item()!r} bit for bit"
        n = sum(t.numel() for t in outputs[:-1])
        got, want = workload.sq_norm.double().item(), workload.reference_norm.double().item()
        if abs(got - want) > sq_norm_rtol(n) * want:
            return f"sq_norm {got!r} is further than its error bound from the reference's {want!r}"
    return None


def shapes_of(case: Case, blocks: list[int], items: list[int]) -> list[tuple[int | None, int | None]]:
    """(blocks per SM, items per thread): the table's (None, None) first."""
    swept = itertools.product(blocks, items) if case.has_items else ((b, None) for b in blocks)
    return [(None, None), *swept]


def measure_case(device, case: Case, workload: Workload, shapes, reps: int, elements: int,
                 copy_ms: float) -> list[dict]:
    """One row per shape: checked, then timed unless it computed wrong or was refused."""
    rows = []
    table_norm = table_ms = None
    moved = case.bytes_per_element * elements
    for blocks, items in shapes:
        row = {"case": case.name, "op": case.op, "src": SHORT[case.src], "dst": SHORT[case.dst],
               "blocks_per_sm": blocks, "items_per_thread": items, "elements": elements, "copy_ms": copy_ms,
               "copy_gbps": moved / copy_ms / 1e6}
        with contextlib.ExitStack() as shape:
            try:
                shape.enter_context(launch_shape(blocks, items or ITEMS[0]))
            except ValueError as error:
                rows.append({**row, "status": "refused: " + str(error).splitlines()[0]})
                continue
            problem = check(device, workload, table_norm)
            if problem is not None:
                rows.append({**row, "status": "wrong: " + problem})
                continue
            if blocks is None and workload.sq_norm is not None:
                table_norm = workload.sq_norm.clone()  # one call's: the timed calls add to it
            row.update(device.largest_launch(workload.run))
            workload.for_timing()
            times = device.times_ms(workload.run, reps)
        median = statistics.median(times)
        if blocks is None:
            table_ms = median
        rows.append({**row, "status": "ok", "median_ms": median, "p20_ms": percentile(times, 0.2),
                     "p80_ms": percentile(times, 0.8), "gbps": moved / median / 1e6,
                     "pct_of_copy": 100 * copy_ms / median,
                     "vs_table": None if table_ms is None else table_ms / median})
    return rows


def time_copy(device, nbytes: int, reps: int) -> float:
    """Median ms of torch's copy_ of nbytes / 2 bytes: nbytes read and written."""
    src = torch.zeros(nbytes // 2, dtype=torch.uint8, device=device.tensors)
    dst = torch.empty_like(src)
    return statistics.median(device.times_ms(lambda: dst.copy_(src), reps))


def shape_name(row: dict) -> str:
    if row["blocks_per_sm"] is None:
        return "table"
    return f"{row['blocks_per_sm']} x {row['items_per_thread'] or '-'}"


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(device, settings: dict, rows: list[dict], emulated: bool) -> str:
    lines = [f"# Launch-shape sweep on {device.describe()}", ""]
    if emulated:
        lines += ["**Emulated: every time below is the wall-clock time of a CPU that runs each CUDA thread as a "
                  "fiber, meaningless for bandwidth.** What this run shows is that every shape computed right "
                  "(or which did not), and that the sweep runs end to end.", ""]
    lines += [f"{settings['elements']:,} elements in {settings['tensors']} tensors per case; per shape the median of "
              f"{settings['reps']} calls after {WARMUPS} warm-ups ({settings['timer']}). Shape: blocks per SM x items "
              "per thread; `table`: csrc/cuda/launch_shape.cu's for this device. The launcher caps blocks per SM at "
              "what an SM keeps resident of the kernel; grid and registers: the call's largest launch. % of copy: "
              "against torch's copy_ of as many bytes, timed in the same run; vs table: the table shape's time "
              "over this shape's. Every shape was checked against hetcomm.reference before it was timed.", ""]
    wrong = [r for r in rows if r["status"].startswith("wrong")]
    checked = [r for r in rows if r["status"] == "ok" or r["status"].startswith("wrong")]
    lines += [f"**{len(checked) - len(wrong)} of {len(checked)} shapes computed right**"
              + (": wrong: " + "; ".join(f"{r['case']} {shape_name(r)}" for r in wrong) if wrong else "."), ""]

    cases = list(dict.fromkeys(r["case"] for r in rows))
    lines += ["| case | table: grid, % of copy | best shape | its grid, % of copy | best / table |",
              "|---|---|---|---|---|"]
    for case in cases:
        ok = [r for r in rows if r["case"] == case and r["status"] == "ok"]
        table = next((r for r in ok if r["blocks_per_sm"] is None), None)
        if not ok or table is None:
            lines.append(f"| {case} | - | - | - | - |")
            continue
        best = min(ok, key=lambda r: r["median_ms"])
        lines.append(f"| {case} | {fmt(table['grid'], 'd')}, {table['pct_of_copy']:.0f}% | {shape_name(best)} | "
                     f"{fmt(best['grid'], 'd')}, {best['pct_of_copy']:.0f}% | "
                     f"{table['median_ms'] / best['median_ms']:.2f}x |")
    for case in cases:
        case_rows = [r for r in rows if r["case"] == case]
        first = case_rows[0]
        lines += ["", f"## {case}", "",
                  f"Copy of as many bytes: {first['copy_ms']:.3f} ms, {first['copy_gbps']:.0f} GB/s.", "",
                  "| shape | grid | registers | check | median ms | p20-p80 ms | GB/s | % of copy | vs table |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in case_rows:
            if r["status"] != "ok":
                lines.append(f"| {shape_name(r)} | - | - | {r['status']} | - | - | - | - | - |")
                continue
            lines.append(f"| {shape_name(r)} | {fmt(r['grid'], 'd')} | {fmt(r['registers'], 'd')} | ok | "
                         f"{r['median_ms']:.3f} | {r['p20_ms']:.3f}-{r['p80_ms']:.3f} | {r['gbps']:.0f} | "
                         f"{r['pct_of_copy']:.0f}% | {fmt(r['vs_table'], '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="DIR", required=True, help="where the .md and .json go (e.g. $OUT)")
    parser.add_argument("--emulator", choices=["sm61", "sm75", "sm80"],  # tests/cuda_emulator/build.py DEVICES
                        help="run on the CPU emulator of this GPU instead of a real one")
    parser.add_argument("--ops", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--elements", type=int, help=f"per case (default {GPU_DEFAULTS['elements']:,}; "
                                                      f"{EMULATOR_DEFAULTS['elements']:,} emulated)")
    parser.add_argument("--tensors", type=int, help=f"the elements' tensors, of uneven sizes (default "
                                                     f"{GPU_DEFAULTS['tensors']}; "
                                                     f"{EMULATOR_DEFAULTS['tensors']} emulated)")
    parser.add_argument("--reps", type=int, help=f"timed calls per shape (default {GPU_DEFAULTS['reps']}; "
                                                  f"{EMULATOR_DEFAULTS['reps']} emulated)")
    parser.add_argument("--blocks", type=int, nargs="+", help="blocks per SM to try (default: 1 up to the SM's "
                                                              "threads / 256; 1 2 emulated)")
    parser.add_argument("--items", type=int, nargs="+", default=list(ITEMS), help="items per thread to try")
    args = parser.parse_args(argv)
    if args.emulator is None and not torch.cuda.is_available():
        print("error: no CUDA GPU visible to torch (--emulator sm61|sm75|sm80 runs on the CPU)", file=sys.stderr)
        return 1

    device = Emulator(args.emulator) if args.emulator else Gpu()
    defaults = EMULATOR_DEFAULTS if args.emulator else GPU_DEFAULTS
    settings = {key: getattr(args, key) or defaults[key] for key in ("elements", "tensors", "reps")}
    settings["blocks"] = args.blocks or device.default_blocks()
    settings["items"] = args.items
    settings["timer"] = "wall clock, emulated" if args.emulator else "CUDA events"
    sizes = tensor_sizes(settings["elements"], settings["tensors"])
    env = device.environment()
    print(json.dumps(env))
    rows = []
    with device.gpu.running() if args.emulator else contextlib.nullcontext():
        for case in (c for c in CASES if c.op in args.ops):
            try:
                copy_ms = time_copy(device, case.bytes_per_element * settings["elements"], settings["reps"])
                workload = WORKLOADS[case.op](case, sizes, device.tensors)
                rows += measure_case(device, case, workload, shapes_of(case, settings["blocks"], settings["items"]),
                                     settings["reps"], settings["elements"], copy_ms)
                del workload
            except torch.OutOfMemoryError:
                rows.append({"case": case.name, "op": case.op, "status": "skipped: out of memory"})
            if not args.emulator:
                torch.cuda.empty_cache()
            print(f"done {case.name}: " + ", ".join(f"{shape_name(r)} {r['status'].split(':')[0]}"
                                                     for r in rows if r["case"] == case.name), flush=True)

    text = markdown(device, settings, rows, emulated=args.emulator is not None)
    write_results(args.out, "sweep_launch", text, {"environment": env, "settings": settings, "rows": rows},
                  **device.result_name())
    print(text)
    return 1 if any(r["status"].startswith("wrong") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
