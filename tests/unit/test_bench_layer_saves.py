"""benchmarks/bench_layer_saves.py: the smoke run on CPU counts what each variant of a tiny LoRA layer saves for its
backward, and the elementwise recompute saves less than the default compile, which saves less than eager."""

from __future__ import annotations

import json

import bench_layer_saves as bench


def test_smoke_counts_the_saves_of_each_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    assert bench.main(["--smoke"]) == 0
    rows = json.loads((tmp_path / "layer_saves_smoke.json").read_text())
    saved = {r["provider"]: r["p50"] for r in rows if r["mode"] == "saved"}
    assert set(saved) == set(bench.VARIANTS)
    assert saved["compiled_elementwise"] < saved["compiled"] < saved["stock"], saved
    assert "compiled_elementwise" in (tmp_path / "layer_saves_smoke.md").read_text()
