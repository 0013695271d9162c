"""``leantrain compare accelerate launch ...`` on CPU: each of the four runs is an in-process ``accelerate launch``
whose 2 ranks (DeepSpeed ZeRO-2 on CPU, the launcher accelerate offers for 2 CPU processes) run under ``leantrain
run --measure=SPEC``; rank 0's timings, peak memory and losses are the run's, and the verdict says 2 processes."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch


pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without torch.distributed"),
]

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_compare_under_accelerate_launch_measures_rank_zero(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    pytest.importorskip("trl")
    from leantrain.cli import compare

    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "examples")]),
    )
    launch = ["accelerate", "launch", "--config_file", str(REPO / "examples" / "accelerate" / "deepspeed_zero2.yaml")]
    launch += ["--mixed_precision", "no", "--main_process_port", str(free_port())]
    script = [str(REPO / "examples" / "train_sft.py"), "--shape", "tiny-llama", "--batch", "2", "--seq", "64"]
    argv = ["--steps", "4", "--warmup", "1", "--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png")]
    monkeypatch.chdir(tmp_path)
    req = compare.parse([*argv, *launch, *script, "--out", str(tmp_path / "out")], environ=env)
    lines: list[str] = []
    data = compare.compare(req, out=lines.append, environ=env)
    out = "\n".join(lines)
    assert data["world_size"] == 2, out
    assert "2 processes (rank 0's timings)" in out
    # tiny llama SFT on CPU: nothing applies, so compare stops after the first leantrain run (stock, leantrain)
    assert data["order"] == ["stock", "leantrain"] and data["verdict"]["stopped_early"], out
    assert data["verdict"]["text"].startswith("nothing applied: no claim"), out
    assert all(len(run) == 4 for mode in ("stock", "leantrain") for run in data[mode]["step_ms"])
    assert data["stock"]["losses"] == data["leantrain"]["losses"]
