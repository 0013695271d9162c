"""benchmarks/bench_layer_kernels.py --smoke: every shape's decoder layer and kernels timed for both providers (CPU,
torch stand-ins for Liger's kernels), rows and table written, the stand-ins removed afterwards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[2]

import bench_layer_kernels as bench  # noqa: E402


pytest.importorskip("matplotlib")


@pytest.mark.slow
def test_smoke_writes_both_providers_for_every_case(tmp_path, monkeypatch):
    from leantrain.layer_kernels import ops

    real, threads = ops.rms_norm, torch.get_num_threads()
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    try:
        assert bench.main(["--smoke"]) == 0
    finally:
        torch.set_num_threads(threads)  # the smoke run sets one thread
    assert ops.rms_norm is real  # the stand-ins are gone
    rows = json.loads((tmp_path / "layer_kernels.json").read_text())
    cases = {(r["x_value"], r["mode"], r["provider"]) for r in rows}
    for shape, family in bench.SHAPES.items():
        gate = "geglu" if family == "gemma2" else "swiglu"
        for mode in ("decoder layer", "rms_norm", gate, "rope"):
            assert {(shape, mode, "stock"), (shape, mode, "leantrain")} <= cases
    assert all(math.isfinite(r["p50"]) and r["p50"] > 0 and r["config"]["tokens"] == 64 for r in rows)
    assert "| gemma-2-2b | decoder layer |" in (tmp_path / "layer_kernels.md").read_text()
