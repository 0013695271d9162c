"""benchmarks/bench_compile_generation.py: the smoke run on CPU (each variant in its own process, leantrain's
compiled decode step compiled once, rows with the generation split and the commit), and the rule the committed
results give measured.py."""

from __future__ import annotations

import json
from pathlib import Path

import bench_compile_generation as bench  # noqa: E402
import pytest

from leantrain.compile_generation.measured import MEASURED


RESULTS = Path(bench.__file__).parent / "results" / "compile_generation.json"


@pytest.mark.slow
def test_smoke_runs_each_variant_and_writes_the_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert bench.main(["--smoke", "--variants", "stock,leantrain"]) == 0
    rows = json.loads((tmp_path / "compile_generation.json").read_text())
    kinds = {(r["provider"], r["mode"], r["metric"]) for r in rows}
    for provider in ("stock", "leantrain"):
        assert {(provider, mode, "speed") for mode in ("step", "generation", "first_step")} <= kinds
    ours = next(r for r in rows if r["provider"] == "leantrain")
    assert ours["config"]["compiles"] == 1 and ours["commit"] == "abc1234"
    assert (tmp_path / "compile_generation.md").exists() and (tmp_path / "compile_generation.png").exists()


def test_the_committed_results_give_the_rule_in_measured_py():
    """measured.py's qwen2 row is the worst case of the committed rows: the smallest saving a token and the largest
    first-step cost."""
    from _harness import read_rows

    lines = [line for line in bench.emit_rule(read_rows(RESULTS)).splitlines() if line.startswith("saving_ms=")]
    pairs = [tuple(float(part.split("=")[1]) for part in line.split(", ")) for line in lines]
    assert pairs, "no leantrain / stock pairs in the committed results"
    row = MEASURED["qwen2"]
    assert row.saving_ms == pytest.approx(min(p[0] for p in pairs), abs=0.01)
    assert row.compile_s == pytest.approx(max(p[1] for p in pairs), abs=0.05)
