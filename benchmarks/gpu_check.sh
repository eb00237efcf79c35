#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, a CUDA toolkit and a CUDA build of
# torch. In one run of at most BUDGET_S seconds (default 480):
#   1. builds hetcomm in place for this GPU only (TORCH_CUDA_ARCH_LIST=<its capability>);
#   2. runs the GPU tests: the cuda parametrizations of the op tests, tests/test_cuda_ops.py;
#   3. runs benchmarks/bench_ops_cuda.py, labelled "native";
#   4. on a GPU newer than sm_86 (so not one of the legacy targets), builds a copy of the
#      tree for TORCH_CUDA_ARCH_LIST="7.5+PTX": the GPU then runs the legacy-targeted
#      build through its compute_75 PTX, JIT-compiled by the driver; tests and benchmarks
#      again, labelled "ptx-7.5";
#   5. benchmarks/sweep_launch.py on the native build: every op's launch shapes (blocks per
#      SM x items per thread), each checked against the reference, then timed against the
#      same run's copy at 256M elements in 100 tensors (sweep_launch_<gpu>.md/.json);
#   6. benchmarks/gpu_shard.py: the sharded optimizer state on emulated 11 GB cards (state
#      bytes, step time, the memory probe; four ranks on the one GPU as 11/11/11/32 GB);
#   7. with at least MAX_BATCH_MIN_S seconds left (default 150), benchmarks/gpu_max_batch.py:
#      the largest BERT micro-batch on emulated 12 and 16 GB cards against the planner's
#      cap (needs transformers; it stops starting cases 30 s before the budget ends, and
#      when the budget's timeout cuts a case short it still writes the cases measured).
# Everything (environment, build logs, test reports, benchmark JSON/CSV) goes to $OUT.
#
#   PYTHON=/path/to/venv/bin/python OUT=/tmp/gpu-results bash benchmarks/gpu_check.sh
#
# The device tool brings back at most 8 files from its $OUT: there, run it with OUT in a
# scratch folder and pack that into one archive under the tool's $OUT:
#
#   BUDGET_S=540 OUT=/tmp/gc bash benchmarks/gpu_check.sh; tar czf "$OUT/gpu_check.tgz" -C /tmp/gc .
#
# PARTS (default "tests bench sweep ptx shard max_batch") names the steps to run after the
# native build, e.g. PARTS="tests shard" when device time is short.
#
# Exit status: 0 when every build and test passed (benchmark targets are reported, not
# enforced), 1 otherwise.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-480}
OUT=${OUT:-$ROOT/gpu-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
START=$(date +%s)
FAILED=()

PARTS=${PARTS:-tests bench sweep ptx shard max_batch}
want() { [[ " $PARTS " == *" $1 "* ]]; }
remaining() { echo $((BUDGET_S - ($(date +%s) - START))); }
section() { printf '\n=== %s (%ss elapsed)\n' "$1" "$(($(date +%s) - START))" | tee -a "$LOG"; }

# run NAME DIR CMD...: runs CMD in DIR within what is left of the budget, output to
# $OUT/NAME.log and the main log; records a failure by NAME.
run() {
  local name=$1 dir=$2 left
  shift 2
  left=$(remaining)
  if ((left < 15)); then
    echo "skipped $name: out of time" | tee -a "$LOG"
    FAILED+=("$name (out of time)")
    return 1
  fi
  (cd "$dir" && timeout "$left" "$@") 2>&1 | tee "$OUT/$name.log" >>"$LOG"
  local status=${PIPESTATUS[0]}
  tail -n 25 "$OUT/$name.log"
  if ((status != 0)); then
    FAILED+=("$name (exit $status)")
  fi
  return "$status"
}

# check TREE LABEL ARCHS: build TREE for ARCHS, then test and benchmark it as LABEL.
check() {
  local tree=$1 label=$2 archs=$3
  section "build ($label, TORCH_CUDA_ARCH_LIST=$archs)"
  if ! run "build_$label" "$tree" env TORCH_CUDA_ARCH_LIST="$archs" HETCOMM_CUDA=1 \
      MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" setup.py build_ext --inplace; then
    return 1
  fi
  local imported
  imported=$(cd "$tree" && PYTHONPATH="$tree" "$PY" -c 'import hetcomm; print(hetcomm.__file__)')
  if [[ "$imported" != "$tree/hetcomm/__init__.py" ]]; then
    echo "error: PYTHONPATH=$tree imports hetcomm from $imported" | tee -a "$LOG"
    FAILED+=("import $label")
    return 1
  fi
  want tests || want bench || return 0
  section "GPU tests ($label)"
  want tests && run "tests_$label" "$tree" env PYTHONPATH="$tree" "$PY" -m pytest -q -p no:cacheprovider \
    --junitxml="$OUT/tests_$label.xml" -k "cuda or info" tests/test_cuda_ops.py tests/test_pack.py \
    tests/test_unpack.py tests/test_unscale.py tests/test_cast.py tests/test_adamw.py tests/test_build.py
  want bench || return 0
  section "GPU benchmarks ($label)"
  run "bench_$label" "$tree" env PYTHONPATH="$tree" "$PY" benchmarks/bench_ops_cuda.py --out "$OUT" --label "$label"
}

section "environment"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)'; then
  echo "error: $PY needs a CUDA build of torch that sees a GPU (set PYTHON=...)" | tee -a "$LOG"
  exit 1
fi
CAPABILITY=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))')
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi || echo "nvidia-smi not found"
  "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'
  echo "compute capability $CAPABILITY"
  "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version || command -v nvcc
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt" | tee -a "$LOG"

check "$ROOT" native "$CAPABILITY"

if want sweep; then
  section "launch-shape sweep (native)"
  run sweep "$ROOT" env PYTHONPATH="$ROOT" "$PY" benchmarks/sweep_launch.py --out "$OUT"
fi

if want shard; then
  section "sharded state on emulated cards"
  run shard "$ROOT" env PYTHONPATH="$ROOT" "$PY" benchmarks/gpu_shard.py --out "$OUT"
fi

if want ptx && (("${CAPABILITY/./}" > 86)); then
  # At least ~3 minutes for a second build, the tests and the benchmarks.
  if (($(remaining) < 180)); then
    echo "skipped the 7.5+PTX build: $(remaining)s left" | tee -a "$LOG"
    FAILED+=("ptx-7.5 (out of time)")
  else
    PTX_TREE=$(mktemp -d)
    trap 'rm -rf "$PTX_TREE"' EXIT
    cp -r "$ROOT/csrc" "$ROOT/hetcomm" "$ROOT/tests" "$ROOT/benchmarks" "$ROOT/setup.py" "$ROOT/pyproject.toml" \
      "$ROOT/README.md" "$PTX_TREE/"
    rm -f "$PTX_TREE"/hetcomm/_C*.so
    check "$PTX_TREE" ptx-7.5 "7.5+PTX"
  fi
fi

if want max_batch && (($(remaining) >= ${MAX_BATCH_MIN_S:-150})); then
  section "largest micro-batch on emulated cards"
  run max_batch "$ROOT" env PYTHONPATH="$ROOT" "$PY" benchmarks/gpu_max_batch.py --out "$OUT" \
    --budget-s "$(($(remaining) - 30))"
else
  echo "skipped gpu_max_batch.py: $(remaining)s left" | tee -a "$LOG"
fi

section "done in $(($(date +%s) - START))s; results in $OUT"
ls -l "$OUT" | tee -a "$LOG"
if ((${#FAILED[@]})); then
  printf 'FAILED: %s\n' "${FAILED[@]}" | tee -a "$LOG"
  exit 1
fi
echo "all builds and tests passed" | tee -a "$LOG"
