#!/usr/bin/env bash
# The one command for a lent GPU machine: installs the carried wheels (scripts/gpu_wheels.sh) beside the
# image's own torch, says which torch it found, and runs scripts/gpu_check.py under a time limit.
# Results go to $OUT (the device tool brings that folder back) or ./gpu_out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 3
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - <<'PY' || exit 4
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
assert (major, minor) >= (2, 4), "chattts-serve needs torch >= 2.4"
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
timeout "${GPU_CHECK_TIMEOUT:-470}" python3 scripts/gpu_check.py --out "$OUT/gpu_results.jsonl" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log"
