"""``benchmarks/gpu_dist.sh``'s launch bookkeeping, with a stand-in launcher instead of training: a launch that exits
with an error after every rank wrote its row (a gloo / DeepSpeed rank aborting at interpreter exit) is kept and noted
with the abort's line; one that exits with an error before every rank wrote fails the script. A few seconds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]

# Stands in for `python -m torch.distributed.run ... --out <dir>`: writes FAKE_RANKS rank rows of a 2-rank run, prints
# what an aborting rank leaves in the log, exits FAKE_RC. Every other use of the interpreter (the table, the check
# of the rows) goes to the real one.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = -m ] && [ "$2" = torch.distributed.run ]; then
  while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done
  "$REAL_PYTHON" - "$out" <<'EOF'
import json, os, sys
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
for rank in range(int(os.environ["FAKE_RANKS"])):
    row = {"example": "sft", "rank": rank, "world_size": 2, "step_ms_p50": 10.0, "device": "cpu",
           "losses": [2.0, 1.5], "kl": [], "num_tokens": 512, "steps": 2}
    (out / f"sft_rank{rank}.json").write_text(json.dumps(row))
EOF
  echo "terminate called without an active exception"
  echo "  exitcode  : -6 (pid: 123)"
  exit "$FAKE_RC"
fi
exec "$REAL_PYTHON" "$@"
"""


def launch(tmp_path: Path, ranks: int, rc: int) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    out = tmp_path / "out"
    env.update(OUT=str(out), PYTHON=str(fake), REAL_PYTHON=sys.executable, FAKE_RANKS=str(ranks), FAKE_RC=str(rc))
    env.update(BENCH_COMMIT="test", BUDGET="200", PYTHONPATH=str(ROOT / "src"))
    result = subprocess.run(
        ["bash", "benchmarks/gpu_dist.sh", "--smoke", "sft_lora.ddp.leantrain"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = (out / "dist" / "launches.tsv").read_text().splitlines()
    return result, [line.split("\t") for line in lines[1:]]


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")
def test_error_after_every_rank_wrote_is_kept_and_noted(tmp_path):
    result, launches = launch(tmp_path, ranks=2, rc=1)
    assert result.returncode == 0, result.stdout + result.stderr
    ((name, rc, _, why),) = launches
    assert (name, rc) == ("sft_lora.ddp.leantrain", "1")
    assert why == "exit 1 after every rank wrote its row (teardown): terminate called without an active exception"
    # the rows are the table's, not a failure row
    (rows_path,) = (tmp_path / "out" / "dist" / "results").glob("*.json")
    (row,) = json.loads(rows_path.read_text())["rows"]
    assert (row["ranks_reported"], row["failed"], row["step_ms_p50"]) == (2, [], 10.0)
    assert "exitcode  : -6" in result.stdout  # the launcher's exit-code line is shown with the launch


@pytest.mark.skipif(shutil.which("setsid") is None, reason="needs setsid")
def test_error_before_every_rank_wrote_fails(tmp_path):
    result, launches = launch(tmp_path, ranks=1, rc=1)
    assert result.returncode == 1
    ((name, rc, _, why),) = launches
    assert (name, rc) == ("sft_lora.ddp.leantrain", "1") and "teardown" not in why
    assert "terminate called without an active exception" in result.stdout
