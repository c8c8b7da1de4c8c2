#!/usr/bin/env bash
# The one command for a lent GPU machine, 8 minutes in all (GPU_CHECK_TOTAL_S) including the install:
#   1. preflight: the wheels scripts/gpu_wheels.sh fetched into .whl/ are present (.whl/ is git-ignored:
#      the device tool carries it only when named) and installed beside the image's own torch; every
#      import the check needs works; torch >= 2.11 with CUDA (the CUDA path uses no newer API).
#   2. scripts/gpu_check.py with what is left of the 8 minutes (each check in its own process).
# Results go to $OUT (the device tool brings that folder back) or ./gpu_out: preflight.json,
# gpu_results.jsonl, gpu_results.summary.json (rewritten after every check and on SIGTERM), gpu_check.log.
# Arguments go to gpu_check.py; with --device cpu (its self-test) the wheels are optional.
set -uo pipefail
start=$(date +%s)
total="${GPU_CHECK_TOTAL_S:-480}"
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
WHEELS="pybase16384 av pypinyin platformdirs"  # as scripts/gpu_wheels.sh downloads them
cpu=0
prev=""
for a in "$@"; do
  if [ "$prev" = "--device" ] && [ "$a" = "cpu" ]; then cpu=1; fi
  if [ "$a" = "--device=cpu" ]; then cpu=1; fi
  prev="$a"
done

fail() {  # a preflight failure: say why, in the summary file the check would have written
  echo "gpu_check.sh: preflight failed: $1" | tee -a "$OUT/gpu_check.log" >&2
  printf '{"check": "summary", "passed": false, "complete": false, "preflight": "%s"}\n' "$1" \
    > "$OUT/gpu_results.summary.json"
  exit "$2"
}

missing=""
for w in $WHEELS; do
  ls .whl/"$w"-*.whl >/dev/null 2>&1 || missing="$missing $w"
done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || fail "pip could not install the carried wheels in .whl/" 3
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
MISSING_WHEELS="$missing" CPU_SELF_TEST="$cpu" python3 - "$OUT/preflight.json" <<'PY' || fail "see preflight.json" 4
import importlib, json, os, sys

report = {"missing_wheels": os.environ["MISSING_WHEELS"].split(), "imports": {}, "problems": []}
for name in ("torch", "numpy", "safetensors", "pybase16384", "av", "pypinyin", "platformdirs", "chattts_serve",
             "chattts_serve.engine.engine", "chattts_serve.server.app"):
    try:
        mod = importlib.import_module(name)
        report["imports"][name] = getattr(mod, "__version__", "ok")
    except Exception as exc:  # noqa: BLE001 - reported
        report["imports"][name] = f"{type(exc).__name__}: {exc}"
        wheel = name in report["missing_wheels"]
        report["problems"].append(f"import {name} failed" + (" (its wheel is not in .whl/)" if wheel else ""))
import torch

cuda = torch.cuda.is_available()
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
report.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=cuda,
              devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [])
if os.environ["CPU_SELF_TEST"] != "1":
    if not cuda:
        report["problems"].append("no CUDA device")
    if (major, minor) < (2, 11):
        report["problems"].append(f"the CUDA path needs torch >= 2.11, found {torch.__version__}")
elif (major, minor) < (2, 4):
    report["problems"].append(f"chattts-serve needs torch >= 2.4, found {torch.__version__}")
json.dump(report, open(sys.argv[1], "w"), indent=1)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {cuda}; preflight:",
      "ok" if not report["problems"] else "; ".join(report["problems"]))
sys.exit(1 if report["problems"] else 0)
PY
left=$(( total - ($(date +%s) - start) - 15 ))
[ "$left" -gt 30 ] || fail "the install left ${left} s of ${total} s" 5
# gpu_check.py stops starting checks at --deadline-s; timeout's SIGTERM (a few seconds later) makes it
# write the summary so far and exit.
timeout -k 10 "$(( left + 5 ))" python3 scripts/gpu_check.py --out "$OUT/gpu_results.jsonl" \
  --summary "$OUT/gpu_results.summary.json" --deadline-s "$left" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
