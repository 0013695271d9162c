"""benchmarks/bench_offload_hooks.py: the smoke run on CPU times the checkpointed chain with and without the offload's
hooks, the hooks moving every layer's input (a chain without them would time nothing of theirs), times an older copy
of the hooks beside (--baseline-ops), and refuses shapes that time nothing and a baseline that is no copy of them."""

from __future__ import annotations

import json
from pathlib import Path

import bench_offload_hooks as bench
import pytest


def test_smoke_times_both_variants_and_the_hooks_move_each_layer_input(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    assert bench.main(["--smoke"]) == 0
    rows = json.loads((tmp_path / "offload_hooks_smoke.json").read_text())
    chains = {(r["x_value"], r["provider"]): r for r in rows if r["mode"] == "chain"}
    assert set(chains) == {(t, v) for t in (16, 32) for v in ("stock", "hooks")}
    for (tokens, variant), row in chains.items():
        assert row["p50"] > 0 and row["p20"] <= row["p50"] <= row["p80"], row
        layers = row["config"]["layers"]
        assert row["config"]["packed_per_chain"] == (layers if variant == "hooks" else 0), (tokens, variant)
    text = (tmp_path / "offload_hooks_smoke.md").read_text()
    assert "µs a layer" in text and (tmp_path / "offload_hooks_smoke.png").exists()


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--tokens", ""], ["--tokens", "2048,-1"]])
def test_shapes_that_time_nothing_are_refused(argv, monkeypatch, tmp_path):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)  # past the no-CUDA check to the shape check
    with pytest.raises(SystemExit, match="must be positive"):
        bench.main(argv)


def test_a_baseline_copy_of_the_hooks_is_timed_in_the_same_rounds(tmp_path, monkeypatch):
    """``--baseline-ops`` loads another copy of ops.py (here this checkout's own, as ``git show REV:...`` would
    write one) and times its hooks beside; they move every layer's input too."""
    import leantrain.offload_checkpoints.ops as ops

    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    copy = tmp_path / "old_ops.py"
    copy.write_text(Path(ops.__file__).read_text())
    assert bench.main(["--smoke", "--baseline-ops", str(copy)]) == 0
    rows = json.loads((tmp_path / "offload_hooks_smoke.json").read_text())
    baseline = [r for r in rows if r["provider"] == "baseline_hooks"]
    assert [r["x_value"] for r in baseline] == [16, 32]
    assert all(r["config"]["packed_per_chain"] == r["config"]["layers"] for r in baseline)
    assert all(r["config"]["ops"] == str(copy) for r in baseline)
    assert "the baseline's" in (tmp_path / "offload_hooks_smoke.md").read_text()


def test_a_baseline_that_is_not_a_copy_of_the_hooks_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    with pytest.raises(SystemExit, match="no such file"):
        bench.main(["--smoke", "--baseline-ops", str(tmp_path / "missing.py")])
    other = tmp_path / "other.py"
    other.write_text("X = 1\n")
    with pytest.raises(SystemExit, match="has no HostOffload"):
        bench.main(["--smoke", "--baseline-ops", str(other)])
