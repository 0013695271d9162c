"""benchmarks/bench_compile_layers.py's plumbing without CUDA: each variant runs in its own process, a variant that
fails is a row with its error (the run goes on), the rows land in $BENCH_RESULTS with the commit gpu_run.sh sets, and
the children's scratch files do not."""

from __future__ import annotations

import json

import bench_compile_layers as bench  # noqa: E402
import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine would run the variant for real")
def test_a_variant_without_cuda_is_a_row_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    bench.main(["--variants", "stock", "--sets", "fixed"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compile_layers.json"]
    result = json.loads((tmp_path / "compile_layers.json").read_text())
    assert result["env"]["commit"] == "abc1234" and result["setup"].startswith("Compiled decoder layers")
    (row,) = result["rows"]
    assert (row["variant"], row["set"]) == ("stock", "fixed") and row["error"]
