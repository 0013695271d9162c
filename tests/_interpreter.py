"""Run a script under Triton's CPU interpreter in a fresh process (``TRITON_INTERPRET`` must be set before triton is
imported, and this test process has imported it already) and load the results it saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, results: Path, timeout: float = 600) -> dict:
    """``python -c script results`` with TRITON_INTERPRET=1 and the repo on the path; the dict it ``torch.save``d."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(results)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(results, weights_only=False)
