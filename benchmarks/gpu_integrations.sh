#!/usr/bin/env bash
# The integrations' GPU check, in one device call: installs transformers, accelerate and
# lightning from wheels carried in gpu-wheels/ when the machine lacks them (it cannot reach
# an index), builds hetcomm for this GPU only, then the PARTS (default all three):
#   tests      the integrations' CPU tests against the machine's own transformers (another
#              version than CI's)
#   trainer    benchmarks/gpu_integrations.py (BalancedTrainer, fp16 and bf16)
#   lightning  benchmarks/gpu_lightning.py (BalancedStrategy, 16-mixed)
#   OUT=/tmp/out [PARTS="trainer lightning"] bash benchmarks/gpu_integrations.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu-results}
PARTS=${PARTS:-tests trainer lightning}
want() { [[ " $PARTS " == *" $1 "* ]]; }
mkdir -p "$OUT"
cd "$ROOT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  for package in transformers accelerate lightning; do
    if ! "$PY" -c "import $package" 2>/dev/null && [ -d gpu-wheels ]; then
      "$PY" -m pip install --quiet --no-index --find-links gpu-wheels "$package"
    fi
  done
  "$PY" -c "import transformers, accelerate; print('transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
  CAP=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  time TORCH_CUDA_ARCH_LIST="$CAP" HETCOMM_CUDA=1 MAX_JOBS=16 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1
  tail -3 "$OUT/build.log"
  "$PY" -m hetcomm info | head -30
  if want tests; then
    PYTHONPATH="$ROOT" "$PY" -m pytest -q -p no:cacheprovider tests/test_integration_transformers.py \
      tests/test_integration_accelerate.py tests/test_integration_timing.py tests/test_example_hf_trainer.py \
      > "$OUT/integration_tests.log" 2>&1
    echo "integration tests: exit $?; $(tail -1 "$OUT/integration_tests.log")"
  fi
  status=0
  if want trainer; then PYTHONPATH="$ROOT" "$PY" benchmarks/gpu_integrations.py --out "$OUT" || status=1; fi
  if want lightning; then PYTHONPATH="$ROOT" "$PY" benchmarks/gpu_lightning.py --out "$OUT" || status=1; fi
  exit $status
} 2>&1 | tee "$OUT/gpu_integrations.log"
exit "${PIPESTATUS[0]}"
