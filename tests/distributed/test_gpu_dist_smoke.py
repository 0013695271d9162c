"""``bash benchmarks/gpu_dist.sh --smoke``: the two-GPU benchmark's plumbing on CPU (2 processes, gloo, tiny model,
SFT stock vs leantrain under torchrun) down to its rows and markdown table. About 1 to 2 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_dist_smoke(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable, BENCH_COMMIT="smoke")
    result = subprocess.run(
        ["bash", "benchmarks/gpu_dist.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (rows_path,) = (tmp_path / "dist" / "results").glob("dist_cpu*_smoke.json")
    rows = {r["variant"]: r for r in json.loads(rows_path.read_text())["rows"]}
    assert set(rows) == {"stock", "leantrain"}
    assert rows["stock"]["applied"] == [] and rows["leantrain"]["applied"] == ["cggr"]
    for row in rows.values():
        assert row["world_size"] == 2 and row["ranks_reported"] == 2 and row["step_ms_p50"] > 0
        assert row["tokens_per_s_per_gpu"] > 0 and row["losses"]
    assert rows["leantrain"]["loss_max_rel_diff_vs_stock"] is not None
    assert (tmp_path / "dist.tgz").stat().st_size > 0
    assert "| sft | ddp | leantrain |" in rows_path.with_suffix(".md").read_text()
