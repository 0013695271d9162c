"""``torchrun --nproc-per-node 2 -m leantrain run ...`` on CPU (gloo): both ranks' trainers are patched at train(),
the report is printed once (rank 0), and the ranks really trained together (world size 2, same report)."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from _launch import launch


pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed"),
]

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "tests" / "unit" / "_run_target.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_patches_every_rank_and_prints_once(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "leantrain", "run", "--cggr", str(TARGET), "--out", str(tmp_path), "--save",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    files = [tmp_path / f"result_rank{r}.json" for r in range(2)] + [tmp_path / "model" / "leantrain.json"]
    done = launch(command, files, cwd=REPO, env=env, timeout=400)
    log = done.stdout + done.stderr
    assert log.count("leantrain patch report (Trainer)") == 1, log[-4000:]
    ranks = [json.loads(path.read_text()) for path in files[:2]]
    for rank, got in enumerate(ranks):
        assert got["world"] == 2 and got["global_step"] == 2, rank
        cggr = next(o for o in got["report"]["outcomes"] if o["name"] == "cggr")
        assert (cggr["status"], cggr["source"]) == ("applied", "cli"), (rank, cggr)
        assert not [h for h in got["log_history"] if any(k.startswith("leantrain") for k in h)], rank
    assert ranks[0]["report"] == ranks[1]["report"]
    record = json.loads((tmp_path / "model" / "leantrain.json").read_text())  # by the rank that saves weights
    assert record["report"] == ranks[0]["report"]
