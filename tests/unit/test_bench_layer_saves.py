"""benchmarks/bench_layer_saves.py: the smoke run on CPU counts what each variant of a tiny LoRA layer saves for its
backward, and the elementwise recompute saves less than the default compile, which saves less than eager; the
one-GEMM LoRA projections save no more than the two-GEMM ones (each projection's input once, not a copy each)."""

from __future__ import annotations

import json

import bench_layer_saves as bench
import pytest


def test_smoke_counts_the_saves_of_each_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    assert bench.main(["--smoke"]) == 0
    rows = json.loads((tmp_path / "layer_saves_smoke.json").read_text())
    saved = {r["provider"]: r["p50"] for r in rows if r["mode"] == "saved"}
    assert set(saved) == set(bench.VARIANTS)
    assert saved["compiled_elementwise"] < saved["compiled"] < saved["stock"], saved
    assert saved["compiled"] <= saved["compiled_two_gemm"], saved
    assert saved["compiled_chunked_mlp"] < saved["compiled"], saved  # no product of gate and up kept for down's A
    assert "compiled_elementwise" in (tmp_path / "layer_saves_smoke.md").read_text()


def test_smoke_quant_counts_the_saves_of_qlora_layers(tmp_path, monkeypatch):
    """--quant: the layer's linears in nf4 (PEFT's 4-bit LoRA class, the rank-side forward bound on it), rows named
    by the shape with -qlora, written to layer_saves_smoke_qlora.*; compiling saves less than the eager layer."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    assert bench.main(["--smoke", "--quant"]) == 0
    rows = json.loads((tmp_path / "layer_saves_smoke_qlora.json").read_text())
    saved = {r["provider"]: r["p50"] for r in rows if r["mode"] == "saved"}
    assert set(saved) == set(bench.VARIANTS) and {r["x_value"] for r in rows} == {"tiny-qlora"}
    assert saved["compiled"] < saved["stock"], saved
