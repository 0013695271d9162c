"""Helpers of the Triton interpreter tests: run a script under Triton's CPU interpreter in a fresh process
(``TRITON_INTERPRET`` must be set before triton is imported, and this test process has imported it already) and load
the results it saved; check results against elementwise error bounds."""

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


def assert_within(ours: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """Finite, and ``|ours - ref| <= bound`` elementwise; the message names the worst element's error and bound."""
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    err = (ours.double() - ref.double()).abs()
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (
        f"{what}: |diff| {err.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g}"
    )
