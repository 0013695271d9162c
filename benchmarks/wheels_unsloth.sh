#!/usr/bin/env bash
# Build the wheel bundle of the Unsloth comparison (benchmarks/bench_vs_unsloth.py) into DIR (default .whl_unsloth/
# at the repo root, git-ignored): every wheel the GPU image lacks for one stack shared by all providers (TRL 1.15,
# PEFT, Accelerate, Liger, CCE, datasets 4.x) and, for the Unsloth process only, Unsloth and its import-time extras.
# transformers is not in it: Unsloth 2026.10.9 accepts <= 5.17, which the image has. bitsandbytes (42 MB) is a
# separate bundle (.whl_bnb/). Unsloth's wheel is repacked without studio/ (its web UI, 82 MB unpacked, never
# imported by `import unsloth`) so repo + bundles fit the device's 64 MiB carry limit.
#   bash benchmarks/wheels_unsloth.sh [DIR]
set -euo pipefail
DIR=${1:-$(git rev-parse --show-toplevel)/.whl_unsloth}
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
# the shared stack (pure Python) and Unsloth's pure-Python extras that the image lacks (tyro and its two deps)
"$PY" -m pip download -q --no-deps -d "$DIR" \
  trl==1.15.0 peft==0.21.2 accelerate==1.15.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1 \
  datasets==4.8.5 dill==0.4.0 unsloth_zoo==2026.10.9 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
# multiprocess ships one wheel per Python: the image's (3.12)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$DIR" multiprocess==0.70.18
"$PY" -m pip download -q --no-deps -d "$tmp" unsloth==2026.10.9
"$PY" "$(dirname "$0")/slim_wheel.py" "$tmp"/unsloth-2026.10.9-py3-none-any.whl \
  "$DIR"/unsloth-2026.10.9-py3-none-any.whl --drop 'studio/*'
ls -la "$DIR"
du -sh "$DIR"
