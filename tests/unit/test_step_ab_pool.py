"""benchmarks/step_ab_pool.py: several bench_step_ab runs pooled (the matched steps, the pooled pair median and its
interval, the token ranges) and the errors that stop it before it writes anything."""

from __future__ import annotations

import json
import math

import pytest
import step_ab_pool as pool
from _harness import Row, write_results


STAMP = {"device": "NVIDIA H200", "versions": {"torch": "2.11.0"}, "date": "2026-12-01T00:00:00+00:00",
         "commit": "abc1234"}  # fmt: skip


def segment(ms, tokens, compiled=None):
    return {"ms": ms, "compiled": compiled or [False] * len(ms), "tokens": tokens}


def write_run(tmp_path, name, base_steps, variant_steps, pair_ratios, options=None):
    """A bench_step_ab JSON of two rows whose per-step records are the given segments."""
    options = options or {"offload_checkpoints": "True"}
    base = Row(
        "step_ab",
        "base",
        "step",
        "speed",
        "ms",
        "case",
        "llama-3.2-1b-varlen",
        100.0,
        config={
            "patch_trainer": {"compile_layers": "True"},
            "steps": base_steps,
            "same_batch_pair_speedups": [1.0] * len(pair_ratios),
            "same_batch_speedup": 1.0,
        },
        **STAMP,
    )
    variant = Row("step_ab", "leantrain", "step", "speed", "ms", "case", "llama-3.2-1b-varlen", 101.0,
                  config={"patch_trainer": options, "steps": variant_steps, "same_batch_pair_speedups": pair_ratios,
                          "same_batch_speedup": sorted(pair_ratios)[len(pair_ratios) // 2]}, **STAMP)  # fmt: skip
    write_results(name, [base, variant], "table", tmp_path)
    return tmp_path / f"{name}.json"


def test_matched_steps_skip_each_segments_first_compiling_steps_and_other_batches(tmp_path):
    base = [
        segment([900.0, 10.0, 20.0, 30.0, 40.0], [5000, 1000, 3000, 5000, 1000], [True, False, False, False, False])
    ]
    variant = [
        segment([800.0, 11.0, 22.0, 27.0, 44.0], [5000, 1000, 3000, 5000, 1200], [True, False, True, False, False])
    ]
    run = pool.load_run(write_run(tmp_path, "r", base, variant, [0.95]))
    steps = pool.matched_steps(run)
    # step 0: each segment's first; step 2: the variant compiled; step 4: other tokens
    assert [(s.tokens, s.base_ms, s.variant_ms) for s in steps] == [(1000, 10.0, 11.0), (5000, 30.0, 27.0)]
    assert pool.summed_ratio(steps) == pytest.approx(40.0 / 38.0)
    ranges = pool.by_tokens(steps, [2048, 4096])
    assert ranges == [("under 2,048", pytest.approx(10 / 11), 1), ("4,096 and more", pytest.approx(30 / 27), 1)]


def test_pooled_rows_take_every_pair_and_the_runs_stamp(tmp_path):
    seg = [segment([1.0, 10.0, 10.0], [2000, 2000, 5000])]
    var = [segment([1.0, 12.5, 8.0], [2000, 2000, 5000])]
    files = [write_run(tmp_path, f"r{i}", seg, var, ratios) for i, ratios in enumerate(([0.9, 1.0, 1.1], [0.8, 1.2]))]
    out = pool.main(["--name", "pooled", "--token-edges", "4096", "--out", str(tmp_path / "out"), *map(str, files)])
    rows = [Row(**r) for r in json.loads((out / "pooled.json").read_text())]
    runs = [r for r in rows if r.provider == "run"]
    pooled = next(r for r in rows if r.provider == "pooled")
    assert [r.p50 for r in runs] == [1.0, 1.2]  # each run's own same-batch median, as bench_step_ab wrote it
    assert pooled.p50 == 1.0 and pooled.config["pairs"] == 5  # the median of 0.8, 0.9, 1.0, 1.1, 1.2
    assert pooled.p20 <= pooled.p50 <= pooled.p80
    assert pooled.config["geometric_mean"] == pytest.approx(math.prod([0.9, 1.0, 1.1, 0.8, 1.2]) ** 0.2)
    assert pooled.config["summed_ratio"] == pytest.approx(40.0 / 41.0)  # (10 + 10) / (12.5 + 8), each run once
    ranges = {r.x_value: r.p50 for r in rows if r.provider == "tokens"}
    assert ranges == {"under 4,096": pytest.approx(0.8), "4,096 and more": pytest.approx(1.25)}
    assert all((r.device, r.commit) == (STAMP["device"], STAMP["commit"]) for r in rows)  # the runs', not this host's
    text = (out / "pooled.md").read_text()
    assert "median **1.000x**" in text and "within the cost line" in text
    assert (out / "pooled.png").stat().st_size > 0


def test_the_interval_is_the_same_for_the_same_pairs_and_narrows_with_more():
    few = [0.8, 0.9, 1.0, 1.1, 1.2]
    assert pool.bootstrap_median(few) == pool.bootstrap_median(few)
    low, high = pool.bootstrap_median(few)
    many_low, many_high = pool.bootstrap_median(few * 20)
    assert low < many_low <= 1.0 <= many_high < high


def test_runs_of_other_comparisons_or_without_steps_stop_with_the_reason(tmp_path):
    seg = [segment([1.0, 10.0], [2000, 2000])]
    one = write_run(tmp_path, "one", seg, seg, [1.0])
    other = write_run(tmp_path, "other", seg, seg, [1.0], options={"compile_layers_mlp_chunks": "2"})
    with pytest.raises(SystemExit, match="different cases or options"):
        pool.main(["--name", "x", "--out", str(tmp_path), str(one), str(other)])
    old = json.loads(one.read_text())
    for row in old:
        row["config"].pop("steps")
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="no per-step record"):
        pool.main(["--name", "x", "--out", str(tmp_path), str(tmp_path / "old.json")])
    with pytest.raises(SystemExit, match="no rows"):
        pool.main(["--name", "x", "--out", str(tmp_path), str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="token-edges"):
        pool.main(["--name", "x", "--token-edges", "2k", "--out", str(tmp_path), str(one)])
    with pytest.raises(SystemExit, match="cost-line"):
        pool.main(["--name", "x", "--cost-line", "1.5", "--out", str(tmp_path), str(one)])
    assert not (tmp_path / "x.json").exists()
