"""benchmarks/bench_grpo_logps.py: the GEMM floor and achieved-TFLOP/s columns (issue #13's ratio to the floor)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_grpo_logps as bench  # noqa: E402


def test_gemm_count_and_tflops():
    assert [bench.gemm_count(m, tr) for m, tr in (("forward", False), ("full", False), ("full", True))] == [1, 2, 3]
    # the README's anchor: two N*H*V GEMMs at N=8192, H=2048, V=151936 in 12.9 ms is ~790 TFLOP/s
    assert bench.tflops(8192, 2048, 151936, "full", False, 12.9) == pytest.approx(790.0, rel=2e-3)


@pytest.mark.parametrize("mode, trainable", [("forward", False), ("full", False), ("full", True)])
def test_gemm_floor_runs(mode, trainable):
    hidden, weight = torch.randn(16, 8), torch.randn(32, 8)
    timing = bench.gemm_floor(hidden, weight, mode, trainable, reps=2, warmup=1)
    assert timing.p50 > 0 and len(timing.samples) == 2


def test_keep_provider_only_in_trainable_rows(monkeypatch):
    """leantrain_triton_keep (issue #13) is timed next to the others in the trainable-head row and nowhere else."""
    monkeypatch.setattr(bench.ops, "triton_available", lambda: True)
    names = list(bench.providers("cuda"))  # CUDA's list; nothing is called
    assert "leantrain_triton_keep" in names
    trainable = [n for n in names if bench.runs_in_case(n, True)]
    frozen = [n for n in names if bench.runs_in_case(n, False)]
    assert {"leantrain_triton", "leantrain_triton_keep", "trl_chunked", "materialized"} <= set(trainable)
    assert "leantrain_triton_keep" not in frozen and "leantrain_triton" in frozen
    assert "leantrain_triton_keep" not in bench.providers("cpu")


def test_keep_provider_keeps_the_logits():
    """The provider's budget keeps a trainable head's logits (checked through the torch backend on CPU)."""
    run = bench.leantrain_backend("torch", bench.KEEP_ALL_MIB)
    hidden, weight = torch.randn(16, 8), torch.randn(32, 8).requires_grad_()
    logp, _ = run(hidden, weight, torch.randint(0, 32, (16,)))
    assert logp.grad_fn.kept_logits is not None
