#!/usr/bin/env bash
# bitsandbytes for the GPU machine in DIR (default .whl_bnb/ at the repo root, git-ignored), trimmed to the CUDA 13.0
# library that the machine's torch (cu130) loads: the full wheel (43 MB, one library per CUDA and ROCm release) leaves
# too little of the 64 MiB a device call carries. Carry it as WHL_BNB for gpu_vs_unsloth.sh, or beside .whl.
#   bash benchmarks/wheels_bnb.sh [DIR]
set -euo pipefail
DIR=${1:-$(git rev-parse --show-toplevel)/.whl_bnb}
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64 \
  -d "$tmp" bitsandbytes==0.50.2
"$PY" "$(dirname "$0")/slim_wheel.py" "$tmp"/bitsandbytes-0.50.2-*.whl "$DIR"/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl \
  --drop 'bitsandbytes/libbitsandbytes_rocm*' --drop 'bitsandbytes/libbitsandbytes_cuda1[12]*' \
  --drop 'bitsandbytes/libbitsandbytes_cuda132*'
ls -la "$DIR"
