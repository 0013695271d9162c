"""The CGGR fine-tuning quality study's smoke mode on CPU: the whole pipeline (pretrain, fine-tune cells through
patch_trainer, aggregation, JSON/markdown/plot) runs, and what it writes is consistent."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest


SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_cggr_quality.py"


def load_study():
    spec = importlib.util.spec_from_file_location("bench_cggr_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_interpolation_at_equal_wall_clock():
    study = load_study()
    curve = [(0, 0.0, 4.0, 3.0), (5, 1.0, 3.0, 3.2), (10, 3.0, 2.0, 3.4)]
    assert study.interpolate(curve, 0.5, 2) == pytest.approx(3.5)
    assert study.interpolate(curve, 2.0, 3) == pytest.approx(3.3)
    assert study.interpolate(curve, 9.0, 2) == 2.0  # past the end: the last point


def test_cells_cover_the_grid():
    study = load_study()
    cells = study.cells(study.FULL)
    labels = [c.label for c in cells]
    assert len(labels) == len(set(labels)) == 1 + 2 + 2 * 4 * 3  # stock, random x 2 ratios, scoring x ratio x depth
    assert {c.depth for c in cells if c.scoring not in (None, "random")} == {2, 4, -1}


@pytest.mark.slow
def test_smoke_run_writes_consistent_results(tmp_path):
    study = load_study()
    out = study.main(["--smoke", "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--budget-s", "600"])
    rows = json.loads((out / "cggr_quality.json").read_text())
    cells = study.cells(study.SMOKE)
    by_cell = {c.label: [r for r in rows if r["provider"] == c.label] for c in cells}
    start = next(r["config"]["ft_start_loss"] for r in rows)
    for cell in cells:
        measures = {r["x_value"]: r for r in by_cell[cell.label]}
        assert set(measures) == {
            "finetune@equal_steps",
            "pretrain@equal_steps",
            "finetune@equal_time",
            "pretrain@equal_time",
            "train step",
        }
        steps = measures["finetune@equal_steps"]
        assert steps["config"]["seeds"] == study.SMOKE.seeds == len(steps["config"]["per_seed"])
        assert steps["p20"] <= steps["p50"] <= steps["p80"]  # min <= mean <= max over seeds
        if cell.scoring in (None, "random"):
            # one epoch on all labels (or a random half) lowers the held-out loss on its source, well beyond the seeds'
            # spread (measured: -0.07 / -0.06 vs a spread of 0.003 / 0.007). Not asserted for the CGGR cells: at this
            # scale, training on the hardest tokens alone may raise it (loss scoring, full-depth router: +0.15); what
            # CGGR costs in quality is the GPU study's measurement, not the smoke's
            assert start - steps["p50"] > 5 * (steps["p80"] - steps["p20"]), (cell.label, start, steps["p50"])
        kept = measures["train step"]["config"]["kept_fraction"]
        assert kept == 1.0 if cell.scoring is None else 0.5 < kept < 1.0  # ratio 0.5 after a 1-step warmup
    assert "| stock |" in (out / "cggr_quality.md").read_text()
    assert (out / "cggr_quality.png").stat().st_size > 0
