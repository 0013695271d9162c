#!/usr/bin/env bash
# The version matrix: for every floor set of src/leantrain/_compat.py, a fresh venv under .ci/venvs/ with exactly
# that set's pins, then the CPU parity tests of each optimization there; last, COMPATIBILITY.md is generated from
# every set (the latest set records from ./.venv, which .ci/run has just built from the README's test command) and
# compared with the committed file.
#   bash .ci/matrix.sh            # CI: build the floor venvs, test, record, check COMPATIBILITY.md
#   bash .ci/matrix.sh --write    # same, then write COMPATIBILITY.md instead of checking it
#   REUSE_VENVS=1 bash .ci/matrix.sh   # keep existing floor venvs (local iteration)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=check
[ "${1:-}" = "--write" ] && mode=write
compat="python3 src/leantrain/_compat.py"
read -ra sets <<< "$($compat names)"
latest=${sets[-1]}
mkdir -p .ci/venvs
# Each optimization's CPU parity tests (ops, trainers, instance patching); the distributed gloo tests and the CUDA
# suite run on the latest set only (README command / benchmarks/gpu_run.sh).
tests=(tests/parity tests/unit/test_cggr_selection.py tests/unit/test_patching.py)
records=()
status=0
for name in "${sets[@]}"; do
  [ "$name" = "$latest" ] && continue
  venv=.ci/venvs/$name
  start=$(date +%s)
  if [ -z "${REUSE_VENVS:-}" ] || [ ! -x "$venv/bin/python" ]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    echo "+ [$name] pip install $($compat pins "$name") pytest -e ."
    # shellcheck disable=SC2046
    "$venv/bin/pip" install -q $($compat pins "$name") pytest -e . 2>&1 | grep -v "is ignored" || true
  fi
  "$venv/bin/python" -c "import leantrain._compat as c; s = c.current_set(); assert s and s.name == '$name', s"
  installed=$(( $(date +%s) - start ))
  echo "+ [$name] pytest ${tests[*]}"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not gpu and not distributed" -rs "${tests[@]}" \
    || status=1
  "$venv/bin/python" .ci/compat_table.py record "$venv.json" || status=1
  records+=("$venv.json")
  echo "[$name] install ${installed} s, tests + table $(( $(date +%s) - start - installed )) s"
done
.venv/bin/python .ci/compat_table.py record ".ci/venvs/$latest.json" || status=1
records+=(".ci/venvs/$latest.json")
if [ "$mode" = write ]; then
  python3 .ci/compat_table.py render "${records[@]}" > COMPATIBILITY.md
  echo "wrote COMPATIBILITY.md"
else
  python3 .ci/compat_table.py render "${records[@]}" --check COMPATIBILITY.md || status=1
fi
exit $status
