#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels scripts/gpu_check.sh installs on a bare GPU machine:
# the packages this project needs that the device image (Python 3.12, its own CUDA torch) lacks.
# Run here (where pip reaches a package index), then carry .whl along with the check.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl pybase16384==0.3.9 av==18.1.0 pypinyin==0.55.0 platformdirs==4.14.9
ls -la .whl
