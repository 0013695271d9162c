#!/usr/bin/env bash
# Run on a 2-GPU machine from the repo root (NCCL, NVLink multicast off): the example scripts under accelerate with
# DDP and FSDP2 and every applicable optimization, plus the OSFT FSDP2 benchmark. Per-rank JSON rows are tarred into
# $OUT/dist.tgz. Carry .whl and .bench_commit.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD/examples:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export BENCH_RESULTS=${OUT:-/tmp/out}/dist BENCH_COMMIT=$(cat .bench_commit 2>/dev/null || echo unknown)
# CGGR would wait 100 optimizer steps by default; these short runs start it after 5.
export LEANTRAIN_CGGR_WARMUP_STEPS=5
mkdir -p "$BENCH_RESULTS"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
launch() { python3 -m accelerate.commands.launch --config_file "examples/accelerate/$1.yaml" "${@:2}"; }
status=0
run() {
  local name=$1; shift
  echo "=== $name"; local start=$(date +%s)
  "$@" > "$BENCH_RESULTS/$name.log" 2>&1; local rc=$?
  grep -A7 "leantrain patch report" "$BENCH_RESULTS/$name.log" | head -8
  if [ $rc = 0 ]; then tail -n 3 "$BENCH_RESULTS/$name.log"; else grep -v Warning "$BENCH_RESULTS/$name.log" | grep -B3 -A3 -m8 "Error\|error:" | tail -n 60; fi
  echo "=== $name rc=$rc in $(( $(date +%s) - start )) s"; [ $rc = 0 ] || status=1
}
want() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
ONLY="$*"
for engine in ddp fsdp2; do
  # CGGR is opt-in (it changes which tokens train): the SFT run asks for it.
  want "sft_$engine" && run "sft_$engine" env LEANTRAIN_CGGR=1 python3 -m accelerate.commands.launch \
      --config_file "examples/accelerate/$engine.yaml" examples/train_sft.py --shape qwen2.5-0.5b --steps 20 \
      --batch 8 --seq 1024 --out "$BENCH_RESULTS/sft_$engine"
  want "sft_osft_$engine" && run "sft_osft_$engine" env LEANTRAIN_OSFT=1 LEANTRAIN_CGGR=0 python3 -m \
      accelerate.commands.launch --config_file "examples/accelerate/$engine.yaml" examples/train_sft.py \
      --shape qwen2.5-0.5b --steps 12 --batch 8 --seq 1024 --out "$BENCH_RESULTS/sft_osft_$engine"
  # TRL loads the reference model from a path when beta > 0; under FSDP2 that copy landed on two devices here, so
  # the FSDP2 run uses beta = 0 (no reference model).
  beta=0.04; [ $engine = fsdp2 ] && beta=0
  want "grpo_$engine" && run "grpo_$engine" launch $engine examples/train_grpo.py --shape qwen2.5-0.5b --steps 4 \
      --batch 16 --generations 8 --completion-length 96 --beta $beta --out "$BENCH_RESULTS/grpo_$engine"
done
want osft_fsdp2_bench && run osft_fsdp2_bench torchrun --nproc-per-node 2 benchmarks/bench_osft.py --fsdp2
python3 examples/summarize.py "$BENCH_RESULTS" | tee "$BENCH_RESULTS/summary.md"
tar czf "${OUT:-/tmp/out}/dist.tgz" --exclude=init-model -C "$BENCH_RESULTS" .
exit $status
