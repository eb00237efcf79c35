"""Mutation check of the CUDA emulator (tests/cuda_emulator): seeds one classic CUDA
bug at a time into a copy of csrc/, runs the CUDA op tests on the emulated GPUs
against it, and records whether they fail and how. The unmutated sources run first and
must pass. A mutant that the tests do not kill is a hole in what CI proves about the
CUDA kernels; the script exits with 1 if there is one.

    python benchmarks/emulator_mutants.py                      # every mutant, table on stdout
    python benchmarks/emulator_mutants.py --out benchmarks/results   # emulator_mutants_cpu.md/.json
    python benchmarks/emulator_mutants.py no_trailing_barrier  # some of them
"""

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from result_files import add_out_arguments, write_results

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "kernels/multi_tensor.cuh"

# name: (file under csrc/, text, replacement, the bug)
MUTANTS = {
    "always_vector": (
        KERNEL, "    if (aligned) {\n", "    if (true) {\n",
        "the 16-byte vector path taken for misaligned chunks (a GPU faults: misaligned address)"),
    "no_trailing_barrier": (
        KERNEL, "  __syncthreads();  // warp_sums is reused by the caller's next round\n", "",
        "block_sum without its trailing barrier: the next chunk's warp sums can overwrite what thread 0 still adds"),
    "no_first_barrier": (
        KERNEL, "    warp_sums[threadIdx.x / 32] = v;\n  }\n  __syncthreads();\n",
        "    warp_sums[threadIdx.x / 32] = v;\n  }\n",
        "block_sum without its first barrier: thread 0 reads warp sums before the other warps write them"),
    "chunk_overrun": (
        KERNEL, "const int n = min(kChunk, args.table.numel[k] - begin);",
        "const int n = min(kChunk, args.table.numel[k] - begin + 1);",
        "one element too many at the end of every segment (reads and writes past the tensor)"),
    "early_exit": (
        KERNEL, "  const float scale = args.scale == nullptr ? 1.0f : *args.scale;\n",
        "  if (kWork == Work::kScaleCastCheckOutputSumSq && threadIdx.x >= 250) return;\n"
        "  const float scale = args.scale == nullptr ? 1.0f : *args.scale;\n",
        "some threads return before the block reduction's shuffles and barriers (a hang on a GPU)"),
    "find_segment_off_by_one": (
        "kernels/find_segment.cuh", "if (table.first_chunk[mid] <= c) {", "if (table.first_chunk[mid] < c) {",
        "the chunk-to-segment search off by one at segment boundaries"),
    "bf16_truncate": (
        "kernels/numeric.cuh", "(bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16", "bits >> 16",
        "software bf16 rounding (before sm_80) truncates instead of rounding to nearest even"),
    "segment_offset_in_elements": (
        "cuda/multi_tensor_cuda.cu", "static_cast<char*>(segment->dst) + done * dst_item,",
        "static_cast<char*>(segment->dst) + done,",
        "a long tensor's later segments written at an offset in elements, not bytes (over its first segment)"),
    "partials_overwritten": (
        "cuda/multi_tensor_cuda.cu", "    partial_base_ += args.table.num_chunks;\n", "",
        "every launch of a long list writes its sums of squares over the first launch's"),
}

TEST_FILES = ["test_pack.py", "test_unpack.py", "test_unscale.py", "test_cast.py", "test_cuda_ops.py",
              "test_cuda_emulator.py"]
# The emulated parametrizations, less the check of the shim's conversions (no csrc/ in
# it). The emulated sm_61's segments are 2^20 elements, so the split of a long tensor is
# among them at a few million elements.
SELECTION = "(emu or test_cuda_emulator) and not shim_conversions"
MAX_FAILURES = 60
FAILED = re.compile(r"^FAILED \S+?::(\S+)")
TARGET = re.compile(r"emu-(sm\d+)-")


def run_tests(csrc: Path, build_dir: Path) -> dict:
    env = dict(os.environ, HETCOMM_EMULATOR_CSRC=str(csrc), HETCOMM_EMULATOR_BUILD_DIR=str(build_dir))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "--tb=line",
               f"--maxfail={MAX_FAILURES}", "-k", SELECTION, *[str(ROOT / "tests" / f) for f in TEST_FILES]]
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    lines = result.stdout.splitlines()
    failed = [m[1] for line in lines if (m := FAILED.match(line))]
    errors = [line for line in lines if re.search(r"^\S+:\d+: ", line)]
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), "")
    return {
        "exit_code": result.returncode,
        "summary": summary,
        "failed": len(failed),
        "failed_on": sorted({m[1] for name in failed if (m := TARGET.search(name))}),
        # Paths as csrc/..., whichever copy of the sources ran.
        "first_error": errors[0].split(": ", 1)[1].replace(f"{csrc.parent}/", "")[:300] if errors else "",
        "seconds": round(seconds, 1),
        "output_tail": "\n".join(lines[-15:]) if result.returncode not in (0, 1) else "",
    }


def mutate(csrc: Path, name: str) -> None:
    path, old, new, _ = MUTANTS[name]
    target = csrc / path
    text = target.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{name}: the text to mutate is not found exactly once in csrc/{path}; update MUTANTS")
    target.write_text(text.replace(old, new))


def table(rows: list[dict]) -> str:
    out = ["| mutant | the bug | killed | failing tests | on | first error reported |", "|---|---|---|---|---|---|"]
    for row in rows:
        error = row["first_error"].replace("|", "\\|")
        out.append(f"| {row['name']} | {row['bug']} | {'yes' if row['killed'] else '**NO**'} | "
                   f"{row['failed']}{'+' if row['failed'] >= MAX_FAILURES else ''} | {', '.join(row['failed_on'])} | "
                   f"{error} |")
    return "\n".join(out)


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else None
    return found[1] if found else platform.machine()


def write_mutant_results(out_dir: str, meta: dict, rows: list[dict]) -> None:
    write_results(
        out_dir, "emulator_mutants",
        f"Emulator mutation check, {meta['date']}, {meta['cpus']}-core {meta['machine']}, torch {meta['torch']}: "
        f"each mutant seeded alone into csrc/, then `pytest -k \"{meta['selection']}\"` over "
        f"tests/{{{','.join(TEST_FILES)}}} "
        f"(stopping after {MAX_FAILURES} failures). Unmutated: {meta['baseline']} in "
        f"{meta['baseline_seconds']} s.\n\n{table(rows)}\n",
        {**meta, "mutants": rows})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutants", nargs="*", default=list(MUTANTS), help="names from MUTANTS (default: all)")
    add_out_arguments(parser)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="hetcomm-mutants-") as work:
        work = Path(work)
        baseline = run_tests(ROOT / "csrc", work / "build")
        print(f"unmutated: {baseline['summary']} ({baseline['seconds']} s)", flush=True)
        if baseline["exit_code"] != 0:
            print(baseline["output_tail"] or baseline["first_error"], file=sys.stderr)
            raise SystemExit("the unmutated sources must pass first")
        for name in args.mutants:
            csrc = work / name / "csrc"
            shutil.copytree(ROOT / "csrc", csrc)
            mutate(csrc, name)
            result = run_tests(csrc, work / "build")
            # Killed: the tests failed (exit 1), not a crash of the test run itself.
            row = {"name": name, "bug": MUTANTS[name][3], "killed": result["exit_code"] == 1, **result}
            rows.append(row)
            print(f"{name}: {'killed' if row['killed'] else 'SURVIVED'}, {result['summary']} ({result['seconds']} s)"
                  f"\n    {result['first_error']}", flush=True)

    print(table(rows))
    if args.out:
        import torch

        meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": cpu_model(),
                "cpus": os.cpu_count(), "torch": torch.__version__, "selection": SELECTION,
                "baseline": baseline["summary"], "baseline_seconds": baseline["seconds"]}
        write_mutant_results(args.out, meta, rows)
    return 0 if all(row["killed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
