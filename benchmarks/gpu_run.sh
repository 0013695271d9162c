#!/usr/bin/env bash
# Run on the GPU machine from the repo root: install the pinned wheels carried in .whl*/ (install_wheels.sh), then run the named
# benchmarks (and the CUDA parity tests with "parity"). Results are tarred into $OUT/results.tgz, logs into $OUT.
#   bash benchmarks/gpu_run.sh parity grpo_logps moe4bit recipes=--recipe,grpo
# "parity" pins one GPU (CUDA_VISIBLE_DEVICES=0 unless set): with two visible GPUs HF Trainer wraps the model in
# nn.DataParallel, which TRL's trainers refuse. "multi_gpu" runs only the tests marked multi_gpu, every GPU visible
# (2+ needed; tests/gpu/test_data_parallel.py): bash benchmarks/gpu_run.sh multi_gpu
# The device copy's .git (if any) is not this checkout's: write `git rev-parse --short HEAD > .bench_commit` first and carry it with .whl.
set -uo pipefail
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_run.sh: $(command -v python3) has no CUDA-enabled torch: run this on the GPU machine (its python3 holds" \
    "PyTorch); on a CPU machine the README's test command runs the suite (the gpu tests skip there)" >&2
  exit 2
fi
bash benchmarks/install_wheels.sh || exit 2  # .whl .whl_core .whl_ds .whl_bnb, whichever were carried
# $PWD on the path: testkit/, the scaffolding benchmarks share with the tests (tests import it the same way).
export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD:/tmp/site PYTHONUNBUFFERED=1
# results go to /tmp and come back as one tarball: $OUT returns at most 8 files
export BENCH_RESULTS=/tmp/bench_results BENCH_COMMIT=$(cat .bench_commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
mkdir -p "$BENCH_RESULTS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
status=0
for job in "$@"; do
  start=$(date +%s)
  echo "=== $job"
  case $job in
    parity) CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python3 -m pytest -q -m "gpu and not multi_gpu" \
              -p no:cacheprovider -rfE --durations=10 --junitxml="${OUT:-/tmp/out}/gpu_parity.xml" \
              tests 2>&1 | tee "${OUT:-/tmp/out}/parity.log" | tail -n 60 ;;
    multi_gpu) NCCL_NVLS_ENABLE=0 MULTI_GPU_TESTS=1 python3 -m pytest -q -m "gpu and multi_gpu" -p no:cacheprovider -rfE \
              --junitxml="${OUT:-/tmp/out}/gpu_multi.xml" tests/gpu 2>&1 | tee "${OUT:-/tmp/out}/multi_gpu.log" | tail -n 60 ;;
    *=*) # name=arg1,arg2: bench_name.py arg1 arg2 (e.g. recipes=--recipe,grpo)
       name=${job%%=*}; IFS=, read -ra args <<< "${job#*=}"
       python3 "benchmarks/bench_$name.py" "${args[@]}" 2>&1 | tee -a "${OUT:-/tmp/out}/$name.log" | tail -n 60 ;;
    *) python3 "benchmarks/bench_$job.py" 2>&1 | tee "${OUT:-/tmp/out}/$job.log" | tail -n 60 ;;
  esac
  rc=${PIPESTATUS[0]}
  echo "=== $job rc=$rc in $(( $(date +%s) - start )) s"
  [ "$rc" = 0 ] || status=1
  tar czf "${OUT:-/tmp/out}/results.tgz" -C "$BENCH_RESULTS" .  # after each job: a run cut off at its limit keeps what finished
done
exit $status
