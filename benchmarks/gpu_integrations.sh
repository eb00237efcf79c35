#!/usr/bin/env bash
# The integrations' GPU check, in one device call: installs transformers and accelerate
# from wheels carried in gpu-wheels/ when the machine lacks them (it cannot reach an
# index), builds hetcomm for this GPU only, runs the integrations' CPU tests against the
# machine's own transformers (another version than CI's), then benchmarks/gpu_integrations.py.
#   OUT=/tmp/out bash benchmarks/gpu_integrations.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu-results}
mkdir -p "$OUT"
cd "$ROOT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
  if ! "$PY" -c "import transformers, accelerate" 2>/dev/null && [ -d gpu-wheels ]; then
    "$PY" -m pip install --quiet --no-index --find-links gpu-wheels transformers accelerate
  fi
  "$PY" -c "import transformers, accelerate; print('transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
  CAP=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  time TORCH_CUDA_ARCH_LIST="$CAP" HETCOMM_CUDA=1 MAX_JOBS=16 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1
  tail -3 "$OUT/build.log"
  "$PY" -m hetcomm info | head -30
  PYTHONPATH="$ROOT" "$PY" -m pytest -q -p no:cacheprovider tests/test_integration_transformers.py \
    tests/test_integration_accelerate.py tests/test_example_hf_trainer.py > "$OUT/integration_tests.log" 2>&1
  echo "integration tests: exit $?; $(tail -1 "$OUT/integration_tests.log")"
  PYTHONPATH="$ROOT" "$PY" benchmarks/gpu_integrations.py --out "$OUT"
} 2>&1 | tee "$OUT/gpu_integrations.log"
exit "${PIPESTATUS[0]}"
