"""benchmarks/bench_offload_toggle.py: the plan of paused and offloaded steps, the pairs' ratios, bad arguments, and
the CPU smoke run (the hooks really paused on the paused steps and moving inputs on the others)."""

from __future__ import annotations

import json

import bench_offload_toggle as toggle
import pytest


def test_the_plan_warms_both_up_then_puts_one_of_each_in_every_pair_in_a_seeded_order():
    plan = toggle.plan_steps(warmup=4, pairs=40, seed=3)
    assert plan[:4] == [False, True, False, True] and len(plan) == 4 + 80
    pairs = [tuple(plan[k : k + 2]) for k in range(4, len(plan), 2)]
    assert set(pairs) == {(True, False), (False, True)}  # both orders occur, never two of a kind
    assert plan == toggle.plan_steps(4, 40, 3) and plan != toggle.plan_steps(4, 40, 4)


def test_a_pairs_ratio_is_the_paused_step_over_the_offloaded_one_and_compiling_pairs_are_dropped():
    plan = [False, True, True, False, False, True, True, False]
    ms = [9.0, 9.0, 110.0, 100.0, 100.0, 120.0, 50.0, 50.0]
    compiled = [True, False, False, False, False, False, False, True]
    # warm-up (2 steps) dropped; pair 1 paused first: 110 / 100; pair 2 offloaded first: 120 / 100; pair 3 compiled
    assert toggle.pair_ratios(plan, ms, compiled, warmup=2) == [1.1, 1.2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--smoke", "--case", "nope"], "unknown case"),
        (["--smoke", "--case", "tiny-moe-qlora"], "dense case"),
        (["--smoke", "--warmup", "1"], "--warmup even"),
        (["--smoke", "--pairs", "0"], "--pairs must be positive"),
    ],
)
def test_bad_arguments_stop_before_any_work(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        toggle.main([*argv, "--out", str(tmp_path)])


@pytest.mark.slow
def test_smoke_pauses_the_hooks_on_the_paused_steps_only(tmp_path):
    for name in ("trl", "peft", "datasets"):
        pytest.importorskip(name)
    toggle.main(["--smoke", "--pairs", "3", "--out", str(tmp_path)])
    rows = {r["provider"]: r for r in json.loads((tmp_path / "offload_toggle.json").read_text())}
    assert rows["paused"]["config"]["packed_per_step"] == 0 and rows["offload"]["config"]["packed_per_step"] > 0
    offload = rows["offload"]["config"]
    assert offload["pairs_kept"] == 3 and len(offload["pair_ratios"]) == 3 and offload["pair_median"] > 0
    low, high = offload["pair_interval"]
    assert low <= offload["pair_median"] <= high
    assert rows["paused"]["config"]["steps_kept"] == rows["offload"]["config"]["steps_kept"] == 3
    assert "median of the pairs' ratios" in (tmp_path / "offload_toggle.md").read_text()
    assert (tmp_path / "offload_toggle.png").stat().st_size > 0
