#!/usr/bin/env bash
# SFT (CGGR opt-in), GRPO and OSFT recipes (examples/train_*.py) under DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3
# (examples/accelerate/*.yaml), each run twice: stock (LEANTRAIN_DISABLE=1) and leantrain. Per-rank JSON rows go to
# $OUT/dist/<recipe>.<engine>.<variant>/; benchmarks/dist_table.py turns them into rows (step time, tokens/s per GPU,
# peak memory per rank, optimizations applied / declined / failed and why, loss and KL agreement with stock) and a
# markdown table under $OUT/dist/results/ (device, versions, date, commit); everything is tarred into $OUT/dist.tgz.
# Copy the two results files into benchmarks/results/distributed/ and commit them.
#
# Two GPUs of one host, from the repo root (NCCL; NVLink multicast stays off: NCCL_NVLS_ENABLE=0, set below too):
#   git rev-parse --short HEAD > .bench_commit        # carried with .whl (the device copy's .git is not this one)
#   NCCL_NVLS_ENABLE=0 bash benchmarks/gpu_dist.sh ddp      # 6 runs (3 recipes x stock/leantrain), ~4-5 min
#   NCCL_NVLS_ENABLE=0 bash benchmarks/gpu_dist.sh fsdp2    # ~4-5 min
#   NCCL_NVLS_ENABLE=0 bash benchmarks/gpu_dist.sh zero2    # ~5 min (needs the DeepSpeed wheels below)
#   NCCL_NVLS_ENABLE=0 bash benchmarks/gpu_dist.sh zero3    # ~5 min (estimates: one launch ~40-50 s on H100s)
#   (one engine, recipe or run per argument: ddp, sft, grpo.zero3, sft_osft.fsdp2.leantrain; none = all 24 runs;
#   osft_fsdp2_bench = the OSFT FSDP2 step benchmark, only when named;
#   each command tables its own runs; to table several together, untar their dist.tgz into one directory here and
#   run `python3 benchmarks/dist_table.py DIR --out benchmarks/results/distributed --commit <commit>`)
# Wheels in .whl/ (installed with --no-deps into /tmp/site): trl, peft, accelerate, bitsandbytes, transformers 5.23,
# and for ZeRO-2/3 DeepSpeed, built here (pure Python: DS_BUILD_OPS=0 compiles no op; the Trainer's torch AdamW is
# handed to DeepSpeed, so no op is JIT-built on the GPU either) with its pure-Python needs:
#   DS_BUILD_OPS=0 pip wheel --no-deps -w .whl deepspeed==0.19.8
#   pip download --no-deps -d .whl hjson==3.1.0 py-cpuinfo==9.0.0 msgpack==1.2.4 einops==0.8.2 nvidia-ml-py \
#       pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
#   pip download --no-deps -d .whl --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.11 \
#       pydantic-core==2.50.5 ninja==1.13.2
# (pydantic 2.14.4 pins pydantic-core 2.50.5 exactly. pydantic-core and ninja are binary wheels: set
# --python-version to the GPU machine's `python3 -V`.)
#
# CPU smoke (2 processes, gloo, tiny model, SFT stock vs leantrain under torchrun; ~1 min): checks the plumbing and the
# table, no GPU:  bash benchmarks/gpu_dist.sh --smoke      (tests/distributed/test_gpu_dist_smoke.py runs it)
set -uo pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
export BENCH_RESULTS=$OUT/dist BENCH_COMMIT=${BENCH_COMMIT:-$(cat .bench_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$BENCH_RESULTS"
PY=${PYTHON:-python3}
if [ $SMOKE = 0 ]; then
  if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)" 2>/dev/null; then
    echo "gpu_dist.sh: needs 2 CUDA devices (bash benchmarks/gpu_dist.sh --smoke runs the CPU smoke)" >&2; exit 2
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD:$PWD/examples:/tmp/site
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
  export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}
fi
# CGGR would wait 100 optimizer steps by default; these short runs start it after 5 (leantrain variant only).
export LEANTRAIN_CGGR_WARMUP_STEPS=5

status=0
run() {  # run <recipe> <engine> <variant> <command...>
  local name="$1.$2.$3"; shift 3
  want "$name" || return 0
  echo "=== $name"; local start=$(date +%s) log="$BENCH_RESULTS/$name.log"
  "$@" > "$log" 2>&1; local rc=$?
  grep -A7 "leantrain patch report" "$log" | head -8
  if [ $rc = 0 ]; then tail -n 2 "$log"; else grep -v Warning "$log" | grep -B3 -A3 -m8 "Error\|error:" | tail -n 40; fi
  echo "=== $name rc=$rc in $(( $(date +%s) - start )) s"; [ $rc = 0 ] || status=1
}
ONLY=" $* "
want() {  # a run is wanted when no selector is given or one selector names its recipe, engine, recipe.engine or all
  [ "$ONLY" = "  " ] && return 0
  local recipe=${1%%.*} rest=${1#*.}; local engine=${rest%%.*}
  for sel in $ONLY; do
    case $sel in "$recipe"|"$engine"|"$recipe.$engine"|"$1") return 0 ;; esac
  done
  return 1
}
variant_env() {  # variant_env <variant> <leantrain settings...>: the environment of one variant
  if [ "$1" = stock ]; then echo LEANTRAIN_DISABLE=1; else shift; echo LEANTRAIN_DISABLE=0 "$@"; fi
}

if [ $SMOKE = 1 ]; then
  for variant in stock leantrain; do
    run sft ddp $variant env $(variant_env $variant LEANTRAIN_CGGR=1 LEANTRAIN_CGGR_WARMUP_STEPS=1) \
      $PY -m torch.distributed.run --nproc-per-node 2 --master-port $((29600 + RANDOM % 200)) examples/train_sft.py \
      --shape tiny-llama --steps 3 --batch 2 --seq 64 --out "$BENCH_RESULTS/sft.ddp.$variant"
  done
else
  launch() { $PY -m accelerate.commands.launch --config_file "examples/accelerate/$1.yaml" "${@:2}"; }
  for engine in ddp fsdp2 zero2 zero3; do
    config=$engine; case $engine in zero2|zero3) config=deepspeed_$engine ;; esac
    # TRL loads the GRPO reference model from a path when beta > 0; under FSDP2 that copy landed on two devices,
    # so the FSDP2 run uses beta = 0 (no reference model, no KL column).
    beta=0.04; [ $engine = fsdp2 ] && beta=0
    for variant in stock leantrain; do
      # CGGR is opt-in (it changes which tokens train): the SFT recipe's leantrain run asks for it.
      run sft $engine $variant env $(variant_env $variant LEANTRAIN_CGGR=1) launch $config examples/train_sft.py \
        --shape qwen2.5-0.5b --steps 12 --batch 8 --seq 1024 --out "$BENCH_RESULTS/sft.$engine.$variant"
      run grpo $engine $variant env $(variant_env $variant) launch $config examples/train_grpo.py \
        --shape qwen2.5-0.5b --steps 4 --batch 16 --generations 8 --completion-length 96 --beta $beta \
        --out "$BENCH_RESULTS/grpo.$engine.$variant"
      # OSFT is opt-in (it changes the model): stock is plain SFT, so its loss column compares OSFT with full SFT.
      run sft_osft $engine $variant env $(variant_env $variant LEANTRAIN_OSFT=1 LEANTRAIN_CGGR=0) launch $config \
        examples/train_sft.py --shape qwen2.5-0.5b --steps 10 --batch 8 --seq 1024 \
        --out "$BENCH_RESULTS/sft_osft.$engine.$variant"
    done
  done
  # The OSFT step benchmark under FSDP2 (its own rows, benchmarks/results via bench_osft.py).
  want osft_fsdp2_bench.bench.leantrain && [ "$ONLY" != "  " ] && run osft_fsdp2_bench bench leantrain \
    $PY -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_osft.py --fsdp2
fi
$PY benchmarks/dist_table.py "$BENCH_RESULTS" --out "$BENCH_RESULTS/results" || status=1
tar czf "$OUT/dist.tgz" --exclude=init-model -C "$BENCH_RESULTS" .
exit $status
