#!/usr/bin/env bash
# Every default optimization under DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 on two GPUs: each recipe below runs as
# its own `accelerate launch` (examples/accelerate/<engine>.yaml, one process per GPU), stock (LEANTRAIN_DISABLE=1)
# and leantrain (its defaults, plus the opt-in a recipe names). Recipes (examples/train_*.py, random init):
#   sft_lora   dense LoRA SFT, Qwen2.5-0.5B shape            defaults (fused loss, layer kernels, ...)
#   sft_full   full fine-tuning SFT (trainable head), same    defaults
#   grpo       GRPO, same shape, beta 0.04 (0 under FSDP2)    defaults (fused log-probs)
#   moe_qlora  Qwen3-30B-A3B shape cut to 4 layers, nf4 experts, LoRA on attention   defaults (moe4bit)
#   osft       full SFT with LEANTRAIN_OSFT=1     (opt-in; its stock is sft_full's stock run of the same engine)
#   cggr       full SFT with LEANTRAIN_CGGR=1, warm-up 2 steps (opt-in; stock: sft_full's stock run)
# Selectors (none = call1): call1 = sft_lora, sft_full and grpo on all four engines (24 launches); call2 =
# moe_qlora, cggr, osft, the OSFT FSDP2 benchmark (osft_bench) and `leantrain compare` (compare); or any recipe,
# engine, recipe.engine or recipe.engine.variant.
# Every launch has its own timeout (LAUNCH_TIMEOUT, 120 s) and the whole script a time budget (BUDGET seconds from
# its start, default 500): a launch that would not fit is skipped and listed so. One failing launch never stops the
# others. Per-rank JSON rows go to /tmp/dist/<recipe>.<engine>.<variant>/, each launch's log beside them, and
# launches.tsv lists every launch (rc, seconds, why; a launch that exits with an error after every rank wrote its row,
# such as a rank aborting in a library's teardown, is kept and noted so). After every launch $OUT/dist.tgz (all of /tmp/dist) and
# $OUT/launches.tsv are rewritten (a call cut off at its limit keeps what finished); at the end
# benchmarks/dist_table.py writes the table ($OUT/dist_table.md) and the script prints it.
#
# On the GPU machine, from the repo root (carry .whl_core .whl_ds .whl_bnb .whl_osft and .bench_commit):
#   git rev-parse --short HEAD > .bench_commit        # the device copy's .git is not this one
#   BUDGET=500 bash benchmarks/gpu_dist.sh call1 > $OUT/gpu_dist.log 2>&1; sed -n '/^=== the table/,$p' $OUT/gpu_dist.log
#   (the last lines name the launches skipped for time: put them first in the next call's selectors)
# Locally, the fetched tarballs into the committed results, docs/distributed.md's table and COMPATIBILITY.md's
# engines section (each call's tarball in its own directory):
#   mkdir -p /tmp/d1 /tmp/d2 && tar xzf <call 1>/dist.tgz -C /tmp/d1 && tar xzf <call 2>/dist.tgz -C /tmp/d2 && \
#     PYTHONPATH=src python3 benchmarks/dist_table.py /tmp/d1 /tmp/d2 --out benchmarks/results/distributed \
#     --commit $(cat .bench_commit) --docs docs/distributed.md && python3 .ci/compat_table.py engines --write COMPATIBILITY.md
# Wheels (installed with --no-deps into /tmp/site from whichever of .whl .whl_core .whl_ds .whl_bnb is there):
# .whl_core: trl, peft, accelerate, transformers, datasets, liger-kernel, cut-cross-entropy; .whl_bnb:
# bitsandbytes; .whl_ds: DeepSpeed, pure Python (the Trainer's torch AdamW is handed to it: no op is built) with
# the needs the GPU image lacks (py3.12 binary for pydantic-core, the exact version pydantic pins):
#   DS_BUILD_OPS=0 pip wheel --no-deps -w .whl_ds deepspeed==0.19.8
#   pip download --no-deps -d .whl_ds hjson==3.1.0 pydantic==2.14.4 annotated-types==0.8.0 \
#       typing-inspection==0.4.5 typing-extensions==4.16.0
#   pip download --no-deps -d .whl_ds --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.12 \
#       pydantic-core==2.50.5
# (the image has msgpack, einops, ninja, nvidia-ml-py, py-cpuinfo, psutil, tqdm). .whl_osft: the
# rhai_innovation_mini_trainer 0.9.0 wheel, the OSFT benchmark's peer (pip download --no-deps).
#
# CPU smoke (2 processes, gloo, tiny model, torchrun instead of accelerate's GPU configs; ~2 min on 2 cores):
#   bash benchmarks/gpu_dist.sh --smoke      (tests/distributed/test_gpu_dist_smoke.py runs it)
set -uo pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Everything is local (random-init models, the embedded corpus, a tokenizer trained on it): no hub look-up may wait
# on a network the GPU machine does not have.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
OUT=${OUT:-/tmp/out}
# The run directories stay out of $OUT (a device call brings back 8 files): $OUT gets dist.tgz, dist_table.md and
# launches.tsv. The smoke keeps them under $OUT/dist for its test to read.
DIST_DIR=${DIST_DIR:-$([ $SMOKE = 1 ] && echo "$OUT/dist" || echo /tmp/dist)}
export BENCH_RESULTS=$DIST_DIR BENCH_COMMIT=${BENCH_COMMIT:-$(cat .bench_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$BENCH_RESULTS"
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET=${BUDGET:-500}                 # seconds for the whole script (the lead's call is 540 s)
LAUNCH_TIMEOUT=${LAUNCH_TIMEOUT:-120} # seconds for one launch
MIN_LAUNCH=${MIN_LAUNCH:-30}          # a launch is not started with less time than this left
RESERVE=20                            # kept for the table and the tarball
if [ $SMOKE = 0 ]; then
  if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)" 2>/dev/null; then
    echo "gpu_dist.sh: needs 2 CUDA devices (bash benchmarks/gpu_dist.sh --smoke runs the CPU smoke)" >&2; exit 2
  fi
  bash benchmarks/install_wheels.sh || exit 2
  export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD:$PWD/examples:/tmp/site PATH=/tmp/site/bin:$PATH
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers, trl, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'accelerate', accelerate.__version__)"
else
  export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD:$PWD/examples${PYTHONPATH:+:$PYTHONPATH}
fi
[ -f "$BENCH_RESULTS/launches.tsv" ] || printf 'run\trc\tseconds\twhy\n' > "$BENCH_RESULTS/launches.tsv"

status=0
PORT=$((29500 + RANDOM % 300))
left() { echo $(( BUDGET - RESERVE - ($(date +%s) - START) )); }
pack() {
  tar czf "$OUT/dist.tgz" --exclude=init-model --exclude=compare_run -C "$BENCH_RESULTS" . 2>/dev/null
  cp "$BENCH_RESULTS/launches.tsv" "$OUT/launches.tsv" 2>/dev/null
}
all_ranks_wrote() {  # all_ranks_wrote <run dir>: every rank of the launch wrote its <example>_rank<r>.json
  $PY - "$1" <<'PYEOF'
import json, sys
from pathlib import Path
rows = [json.loads(p.read_text()) for p in Path(sys.argv[1]).glob("*_rank*.json")]
sys.exit(0 if rows and len({r["rank"] for r in rows}) == rows[0]["world_size"] else 1)
PYEOF
}
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$BENCH_RESULTS/launches.tsv"; }

run() {  # run <name> <command...>: one launch in its own process group, under its own timeout
  local name="$1"; shift
  local budget; budget=$(left)
  if [ "$budget" -lt "${RUN_MIN:-$MIN_LAUNCH}" ]; then
    echo "=== $name skipped: $budget s left of the time budget"; record "$name" skipped 0 "time budget"; return 0
  fi
  local cap=${RUN_LIMIT:-$LAUNCH_TIMEOUT}; local limit=$(( budget < cap ? budget : cap ))
  echo "=== $name (limit $limit s)"; local start; start=$(date +%s); local log="$BENCH_RESULTS/$name.log"
  PORT=$((PORT + 1))
  # setsid: the launch and its workers form one process group, killed as one if anything outlives the timeout
  setsid -w timeout -k 10 "$limit" env MAIN_PORT=$PORT "$@" > "$log" 2>&1 &
  local pid=$!; wait $pid; local rc=$?
  kill -KILL -- -$pid 2>/dev/null
  local secs=$(( $(date +%s) - start )) why=""
  grep -A9 "leantrain patch report" "$log" | head -10
  if [ $rc = 0 ]; then tail -n 1 "$log"
  else
    [ $rc = 124 ] && why="timed out after $limit s" || why=$(grep -v -i "warn" "$log" | grep -E "Error|error:|Traceback" | grep -v "^ *File" | tail -n 1 | cut -c1-300 | tr '\t' ' ')
    # a rank that aborts with no Python error ("terminate called without an active exception", a signal) leaves
    # only the launcher's traceback above: its exit code and signal lines name the cause
    grep -v -i warn "$log" | grep -B2 -A8 -m3 -E "Error|error:" | tail -n 30
    grep -E "terminate called|exitcode|Signal [0-9]" "$log" | head -n 6
    if [ $rc != 124 ] && all_ranks_wrote "$BENCH_RESULTS/$name"; then
      # every rank finished its steps and wrote its row before exiting: an abort in a library's teardown after
      # training (gloo / DeepSpeed threads at interpreter exit) costs nothing measured; the launch is kept, so noted
      why="exit $rc after every rank wrote its row (teardown): $(grep -m1 -E "terminate called|Signal [0-9]" "$log" | cut -c1-120 | tr '\t' ' ')"
      echo "=== $name: $why"
    else
      status=1
    fi
  fi
  record "$name" "$rc" "$secs" "$why"
  echo "=== $name rc=$rc in $secs s"
  pack
}

DEFAULT=call1; [ $SMOKE = 1 ] && DEFAULT="sft_lora sft_full.ddp.stock cggr"
ONLY=" ${*:-$DEFAULT} "
CALL1="sft_lora sft_full grpo"
CALL2="moe_qlora cggr osft osft_bench compare"
want() {  # want <recipe> <engine> <variant>: a selector names it, its recipe, engine, recipe.engine or its call
  local sel
  for sel in $ONLY; do
    case $sel in
      call1) [[ " $CALL1 " == *" $1 "* ]] && return 0 ;;
      call2) [[ " $CALL2 " == *" $1 "* ]] && return 0 ;;
      "$1"|"$2"|"$1.$2"|"$1.$2.$3") return 0 ;;
    esac
  done
  return 1
}
variant_env() {  # variant_env <variant> <leantrain settings...>: the environment of one variant
  if [ "$1" = stock ]; then echo LEANTRAIN_DISABLE=1; else shift; echo LEANTRAIN_DISABLE=0 "$@"; fi
}

if [ $SMOKE = 1 ] && [ "${SMOKE_ENGINES:-}" ]; then
  # SMOKE_ENGINES="fsdp2 zero2 zero3": accelerate launch with those configs on 2 CPU processes (fp32; DeepSpeed's
  # CPU accelerator, which compiles its shared-memory op once, ~1-2 min): the GPU path's launcher and configs
  launch() {
    local config=$1; case $1 in zero2|zero3) config=deepspeed_$1 ;; esac
    DS_ACCELERATOR=cpu $PY -m accelerate.commands.launch --config_file "examples/accelerate/$config.yaml" \
      --mixed_precision no --main_process_port "$MAIN_PORT" "${@:2}"
  }
  ENGINES=$SMOKE_ENGINES
elif [ $SMOKE = 1 ]; then
  # torchrun with 2 gloo ranks stands in for accelerate launch; engine "ddp" (what torchrun gives the Trainer)
  launch() { $PY -m torch.distributed.run --nproc-per-node 2 --master-port "$MAIN_PORT" "${@:2}"; }
  ENGINES=ddp
fi
if [ $SMOKE = 1 ]; then
  DENSE="--shape tiny-llama --steps 3 --batch 2 --seq 64"
  GRPO_ARGS="--shape tiny-llama --steps 3 --batch 4 --generations 4 --completion-length 8"
  MOE="--shape tiny-qwen3_moe --steps 3 --batch 2 --seq 64"
else
  launch() {  # launch <engine> <script args...>
    local config=$1; case $1 in zero2|zero3) config=deepspeed_$1 ;; esac
    $PY -m accelerate.commands.launch --config_file "examples/accelerate/$config.yaml" \
      --main_process_port "$MAIN_PORT" "${@:2}"
  }
  ENGINES="ddp fsdp2 zero2 zero3"
  # 6 steps, the first 2 not timed (examples/_common.py StepStats); 4 x 512 tokens per GPU
  DENSE="--shape qwen2.5-0.5b --steps 6 --batch 4 --seq 512"
  GRPO_ARGS="--shape qwen2.5-0.5b --steps 5 --batch 8 --generations 4 --completion-length 32"
  MOE="--shape qwen3-30b-a3b --layers 4 --steps 6 --batch 2 --seq 512"
fi
export -f launch
export PY

recipe() {  # recipe <recipe> <engine> <variant>: one launch, if wanted
  local r=$1 e=$2 v=$3 out="$BENCH_RESULTS/$1.$2.$3"
  want "$r" "$e" "$v" || return 0
  case $r in
    sft_lora) run "$r.$e.$v" env $(variant_env $v) bash -c 'launch "$@"' _ "$e" examples/train_sft.py $DENSE --lora --out "$out" ;;
    sft_full) run "$r.$e.$v" env $(variant_env $v) bash -c 'launch "$@"' _ "$e" examples/train_sft.py $DENSE --out "$out" ;;
    osft) run "$r.$e.$v" env $(variant_env $v LEANTRAIN_OSFT=1) bash -c 'launch "$@"' _ "$e" examples/train_sft.py $DENSE --out "$out" ;;
    cggr) run "$r.$e.$v" env $(variant_env $v LEANTRAIN_CGGR=1 LEANTRAIN_CGGR_WARMUP_STEPS=2) bash -c 'launch "$@"' _ "$e" \
            examples/train_sft.py $DENSE --out "$out" ;;
    moe_qlora) run "$r.$e.$v" env $(variant_env $v) bash -c 'launch "$@"' _ "$e" examples/train_sft.py $MOE --moe-4bit --out "$out" ;;
    grpo)
      # TRL loads the GRPO reference model from a path when beta > 0; under FSDP2 that copy landed on two devices
      # (2026-11 runs), so the FSDP2 run uses beta = 0 (no reference model, no KL column).
      local beta=0.04; [ "$e" = fsdp2 ] && beta=0
      run "$r.$e.$v" env $(variant_env $v) bash -c 'launch "$@"' _ "$e" examples/train_grpo.py $GRPO_ARGS --beta $beta --out "$out" ;;
  esac
}

# Priority order: what matters most runs first, so a budget that runs out cuts the least important launches:
# recipe by recipe (dense LoRA SFT, the default users meet most, on every engine first), engines in the order
# DDP, FSDP2, ZeRO-2, ZeRO-3. osft and cggr have no stock launch of their own: they are compared with sft_full's
# stock run of the same engine.
for r in sft_lora sft_full grpo; do
  for e in $ENGINES; do for v in stock leantrain; do recipe $r $e $v; done; done
done
if [ $SMOKE = 1 ]; then
  for e in $ENGINES; do
    recipe cggr $e leantrain; recipe osft $e leantrain; recipe moe_qlora $e stock; recipe moe_qlora $e leantrain
  done
else
  for e in ddp fsdp2; do for v in stock leantrain; do recipe moe_qlora $e $v; done; done
  for e in ddp fsdp2; do recipe cggr $e leantrain; recipe osft $e leantrain; done
  # The OSFT FSDP2 step benchmark (1.1B, 4 x 2048 per GPU) against mini_trainer, with a profile of 3 steps of each
  # variant (per-phase times and top kernels in osft_fsdp2_profile/).
  if want osft_bench bench leantrain; then
    RUN_MIN=120 RUN_LIMIT=240 run osft_bench bash -c '$PY -m torch.distributed.run --nproc-per-node 2 --master-port $MAIN_PORT benchmarks/bench_osft.py --fsdp2 --profile'
    grep -h "tokens/s = " "$BENCH_RESULTS/bench_osft_fsdp2.md" 2>/dev/null
    for f in "$BENCH_RESULTS"/osft_fsdp2_profile/*.txt; do [ -f "$f" ] && head -n 7 "$f"; done
  fi
  for v in stock leantrain; do recipe moe_qlora zero2 $v; done
  for e in zero2 zero3; do recipe cggr $e leantrain; done
  # ZeRO-3 partitions the experts (moe4bit declines), ZeRO-2/3 the OSFT factors (OSFT declines): one launch each
  # records the reason the user would see (the CPU tests check these declines already: last in line).
  recipe moe_qlora zero3 leantrain
  for e in zero2 zero3; do recipe osft $e leantrain; done
  # leantrain compare under accelerate launch (4 launches: stock, leantrain, leantrain, stock) on dense LoRA SFT, DDP
  if want compare ddp leantrain; then
    RUN_MIN=120 RUN_LIMIT=240 run compare bash -c '$PY -m leantrain compare --steps 6 --warmup 2 --json "$BENCH_RESULTS/compare_sft_lora_ddp.json" \
      --plot "$BENCH_RESULTS/compare_sft_lora_ddp.png" accelerate launch --config_file examples/accelerate/ddp.yaml \
      --main_process_port $MAIN_PORT examples/train_sft.py --shape qwen2.5-0.5b --batch 4 --seq 512 --lora \
      --out "$BENCH_RESULTS/compare_run"'
  fi
fi
$PY benchmarks/dist_table.py "$BENCH_RESULTS" --out "$BENCH_RESULTS/results" > "$BENCH_RESULTS/table.log" 2>&1 || status=1
cat "$BENCH_RESULTS"/results/dist_*.md > "$OUT/dist_table.md" 2>/dev/null
pack
tail -n 3 "$BENCH_RESULTS/table.log"
echo "=== the table ($OUT/dist_table.md), columns: recipe engine variant step-ms speed-up tokens/s/GPU peak-GiB loss KL"
grep "^| [a-z]" "$OUT/dist_table.md" 2>/dev/null | cut -d'|' -f2-10
echo "=== launches (rc, seconds, why):"; column -t -s $'\t' "$BENCH_RESULTS/launches.tsv" 2>/dev/null || cat "$BENCH_RESULTS/launches.tsv"
left_over=$(awk -F'\t' '$2 == "skipped" {printf "%s ", $1}' "$BENCH_RESULTS/launches.tsv")
[ -n "$left_over" ] && echo "=== skipped for time (name them in the next call): $left_over"
echo "=== total $(( $(date +%s) - START )) s"
exit $status
