#!/usr/bin/env bash
# The Unsloth comparison on the GPU machine, from the repo root, in one device call (benchmarks/bench_vs_unsloth.py;
# its docstring lists the cases). Needs the wheel bundles carried at the repo root's parent or root: .whl_unsloth/
# (benchmarks/wheels_unsloth.sh) and .whl_bnb/ (bitsandbytes). One stack for every provider: the image's torch and
# transformers (5.17, the newest Unsloth 2026.10.9 accepts) with TRL 1.15, PEFT, Accelerate, Liger, datasets 4.x in
# /tmp/site; Unsloth and its extras in /tmp/site_unsloth, on the path of the Unsloth process only.
#   bash benchmarks/gpu_vs_unsloth.sh [bench_vs_unsloth.py arguments, e.g. --cases llama-3.2-1b --providers stock,unsloth]
# Another benchmark with an Unsloth row on the same stack (VS_BENCH, its arguments after it):
#   VS_BENCH=benchmarks/bench_offload_checkpoints.py bash benchmarks/gpu_vs_unsloth.sh --cases llama-3.2-1b
# Results (JSON, markdown, PNG) and the log go to $OUT (or /tmp/out).
set -uo pipefail
WHL=${WHL_UNSLOTH:-$( [ -d .whl_unsloth ] && echo .whl_unsloth || echo ../.whl_unsloth )}
BNB=${WHL_BNB:-$( [ -d .whl_bnb ] && echo .whl_bnb || echo ../.whl_bnb )}
OUT=${OUT:-/tmp/out}
# its own site (TRL 1.15, the image's transformers 5.17), apart from the parity suite's /tmp/site (TRL 1.16)
SITE=${SITE_VS:-/tmp/site_vs}
mkdir -p "$OUT"
only_unsloth='unsloth-*.whl unsloth_zoo-*.whl tyro-*.whl docstring_parser-*.whl typeguard-*.whl'
shared=()
for w in "$WHL"/*.whl; do
  skip=0
  for pat in $only_unsloth; do [[ $(basename "$w") == $pat ]] && skip=1; done
  [ $skip = 0 ] && shared+=("$w")
done
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
if [ ! -f /tmp/site_unsloth/.installed ]; then  # once per machine: a second call in the same session reuses it
  pipi "$SITE" "${shared[@]}" "$BNB"/*.whl || exit 2
  pipi /tmp/site_unsloth $(for pat in $only_unsloth; do echo "$WHL"/$pat; done) || exit 2
  touch /tmp/site_unsloth/.installed
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD:$SITE UNSLOTH_SITE=/tmp/site_unsloth PYTHONUNBUFFERED=1
export BENCH_RESULTS=$OUT BENCH_COMMIT=${BENCH_COMMIT:-$(cat .bench_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, trl, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__)"
start=$(date +%s)
BENCH=${VS_BENCH:-benchmarks/bench_vs_unsloth.py}
name=$(basename "$BENCH" .py)
python3 "$BENCH" "$@" 2>&1 | tee -a "$OUT/${name#bench_}.log"
rc=${PIPESTATUS[0]}
echo "$name rc=$rc in $(( $(date +%s) - start )) s"
exit $rc
