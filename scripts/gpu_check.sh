#!/usr/bin/env bash
# The GPU check (see scripts/gpu_check.py): Gemma 2B architecture, random weights, bfloat16, rank-16 LoRA.
# Prepared for one call of the device tool on a lent H200, whose image has JAX with CUDA but no keras:
#
#   here, once:   bash scripts/gpu_check.sh --fetch-wheels        # keras, keras-hub (+ namex, optree) into .whl/
#   there:        run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# On any machine with keras and keras-hub installed it also runs as is: bash scripts/gpu_check.sh [--config tiny]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl keras==3.15.1 keras-hub==0.32.0 namex optree
  exit 0
fi
if [ -d .whl ] && ! python3 -c "import keras_hub" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
log="${OUT:-/tmp}/gpu_check.log"
# bfloat16 first, then the same with int8 and int4 dense layers (QLoRA), side by side in one run. int4
# goes last: should the call run out of time, the log under $OUT still holds the first two.
{ python3 scripts/gpu_check.py "$@"; python3 scripts/gpu_check.py --quantize int8 --steps 10 "$@";
  python3 scripts/gpu_check.py --quantize int4 --steps 5 "$@"; } 2>&1 \
  | grep -v -E "^(WARNING: All log|I0000|W0000)" | tee "$log"
