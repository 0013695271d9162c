"""Where each run's timing starts: the steady-state detection (MSER) on synthetic step lists, seeded, with exact
expectations; a run that had not settled backs no speed claim; the verdict on a falling stock run measured on a
2-core CPU (the demo's first runs, where a fixed 2-step warm-up claimed ~2x against a steady ~1.3-1.4x); the cuts
recorded beside the verdict and in the table."""

from __future__ import annotations

import math
import random

import pytest

from leantrain.cli import compare
from leantrain.cli import verdict as verdicts
from leantrain.cli._measure import Measurement
from leantrain.cli.runs import CompareRequest


def noisy(seed: int, levels: list[float], sd: float) -> list[float]:
    """Step times around ``levels`` with relative Gaussian noise ``sd``, rounded to 0.1 ms."""
    rng = random.Random(seed)
    return [round(x * (1 + rng.gauss(0, sd)), 1) for x in levels]


FALLING = noisy(0, [200 * (1 + 0.8 * math.exp(-i / 2)) for i in range(30)], 0.03)  # settles within ~6 steps
FLAT = noisy(1, [200.0] * 30, 0.03)
STILL_FALLING = noisy(2, [400 - 200 * i / 29 for i in range(30)], 0.03)  # falls to the last step
SLOW_FIRST = [2000.0, *noisy(3, [200.0] * 29, 0.01)]  # one slow step (set-up), then flat
# 20% noise, no trend (its spike at step 9 goes with the cut)
NOISE = [round(200 * x, 1) for x in map(random.Random(4).lognormvariate, [0] * 30, [0.2] * 30)]


@pytest.mark.parametrize(
    ("steps", "cut", "settled"),
    [(FALLING, 6, True), (FLAT, 2, True), (STILL_FALLING, 15, False), (SLOW_FIRST, 1, True), (NOISE, 9, True)],
    ids=["falling start", "flat", "still falling", "single slow first step", "noise"],
)
def test_the_cut_on_synthetic_runs(steps, cut, settled):
    steady = verdicts.steady_state(steps)
    assert (steady.cut, steady.unsettled is None) == (cut, settled), steady
    if settled:  # the kept steps' median is the steady level, not the start's
        assert verdicts.median(steps[steady.cut :]) == pytest.approx(200, rel=0.1)


def test_mser_minimizes_the_kept_steps_marginal_standard_error():
    """sum((x - mean)^2) / (n - d)^2 over x[d:], d in [1, n//2]: by hand on a 6-step run."""
    steps = [900.0, 300.0, 120.0, 100.0, 104.0, 96.0]
    scores = {}
    for d in range(1, 4):
        kept = steps[d:]
        mean = sum(kept) / len(kept)
        scores[d] = sum((x - mean) ** 2 for x in kept) / len(kept) ** 2
    assert verdicts.mser_cut(steps) == min(scores, key=scores.get) == 3
    assert verdicts.mser_cut([5.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == 1  # equal scores: the shortest cut


def test_a_run_still_falling_at_the_end_has_not_settled():
    steady = verdicts.steady_state(STILL_FALLING)
    assert (
        steady.unsettled == "its step time still falling: median 269.7 ms over steps 16-22, 212.5 ms over steps 24-30"
    )
    assert steady.settling == 23  # still moving through step 23: the rerun suggestion is 3x that


def test_a_cut_at_its_limit_has_not_settled_only_when_the_steps_before_it_still_stand_apart():
    """MSER's cut at half the run is the sign of a run too short to show its steady state, when the steps it left
    out just before the limit are still apart from the kept ones; a noise step that moved the cut there is not."""
    late = verdicts.steady_state([500.0, 480, 460, 440, 420, 200, 201, 199, 200, 200])
    assert late.cut == 5 and late.unsettled == (
        "its step time still falling: median 440.0 ms over steps 3-5, 200.0 ms over steps 6-10, and the cut reached "
        "its limit, half the run"
    )
    spike = verdicts.steady_state([300.0, 200, 200, 200, 240, 200, 201, 199, 200, 200])
    assert spike.cut == 5 and spike.unsettled is None


def test_an_explicit_warmup_is_the_same_cut_for_every_run_and_still_checks_the_trend():
    assert verdicts.steady_state(FALLING, 2).cut == 2 and verdicts.steady_state(FLAT, 7).cut == 7
    assert verdicts.steady_state(STILL_FALLING, 2).unsettled.startswith("its step time still falling")
    assert verdicts.rule_text(3) == (
        "the first 3 steps of every run not timed (--warmup 3, in place of the steady-state detection)"
    )


# --- the verdict --------------------------------------------------------------------------------------------------


def run(label: str, step_ms: list[float]) -> Measurement:
    n = len(step_ms)
    return Measurement(
        label=label,
        steps=list(range(1, n + 1)),
        step_ms=list(step_ms),
        losses=[5.0 - 0.1 * k for k in range(n)],
        tokens=[100] * n,
        peak_bytes=1000,
        applied=["moe4bit"] if label.startswith("leantrain") else [],
        layers=2,
    )


# `leantrain demo --steps 30` on a 2-core Xeon, per-step ms (the first 18 steps): stock keeps falling for about 8
# steps, leantrain is flat from step 1. The one leantrain run recorded stands for both.
STOCK_1 = [399.0, 417, 355, 276, 308, 302, 265, 237, 231, 227, 222, 230, 264, 262, 214, 194, 217, 253]
LEANTRAIN = [202.0, 202, 194, 146, 174, 174, 176, 191, 162, 137, 131, 136, 169, 140, 189, 171, 176, 152]
STOCK_2 = [334.0, 341, 320, 262, 278, 275, 263, 237, 209, 201, 188, 198, 188, 202, 209, 161, 167, 224]


def measured(steps: int) -> list[Measurement]:
    first = [STOCK_1, LEANTRAIN, LEANTRAIN, STOCK_2]
    return [run(label, ms[:steps]) for label, ms in zip(("stock 1", "leantrain 1", "leantrain 2", "stock 2"), first)]


def test_a_falling_stock_run_no_longer_inflates_the_ratio():
    """The 10-step runs: a fixed 2-step warm-up times stock while it still falls (the ratio ~1.5x against a steady
    ~1.3x); the detection says that stock had not settled and asks for more steps."""
    short = verdicts.verdict(measured(10))
    assert short["speed"]["verdict"] == "no claim" and short["keep"] is None
    assert short["text"] == (
        "no claim: stock 1 had not settled within 10 steps (its step time still falling: median 302.0 ms over steps "
        "4-6, 231.0 ms over steps 8-10), nor had stock 2; rerun with more steps (--steps 21)"
    )
    assert verdicts.verdict(measured(10), 2)["speed"]["ratio"] > 1.5  # what the fixed warm-up measured
    longer = verdicts.verdict(measured(18))
    assert [r["cut"] for r in longer["steady"]["runs"]] == [7, 3, 3, 8]  # each run its own cut
    assert all(r["settled"] for r in longer["steady"]["runs"])
    assert 1.2 < longer["speed"]["ratio"] < 1.45, longer["text"]


def test_the_suggestion_is_three_times_the_steps_a_run_was_seen_settling():
    runs = [run(label, STILL_FALLING) for label in ("stock 1", "leantrain 1", "leantrain 2", "stock 2")]
    assert verdicts.verdict(runs)["text"].endswith(
        "nor had leantrain 1, leantrain 2 or stock 2; rerun with more steps (--steps 69)"
    )


def test_a_run_that_had_not_settled_under_the_scripts_own_max_steps_names_the_cap():
    """More steps need the script's own max_steps raised too: the cause says that it capped the runs."""
    runs = measured(10)
    for r in runs:
        r.requested_steps, r.max_steps = 20, 10
    assert verdicts.verdict(runs)["text"].endswith(
        "rerun with more steps (--steps 21); the script capped its runs at max_steps=10 (20 steps asked for)"
    )


def test_a_run_that_had_not_settled_on_a_loaded_host_names_the_load():
    """Other work on the host moves step times too: the cause names the load, and the rerun asks for an idle
    machine as well as more steps."""
    runs = measured(10)
    for r in runs:
        r.host_load, r.cores = [1.0] * 10, 2
    runs[3].host_load = [1.0] * 9 + [6.4]  # stock 2, the second run that had not settled
    assert verdicts.verdict(runs)["text"].endswith(
        "nor had stock 2; the host was loaded during stock 2 (host load average up to 6.4 on 2 cores); rerun on an "
        "idle machine with more steps (--steps 21)"
    )
    runs[3].host_load = [2.4] * 10  # 1.2 a core: not loaded
    assert verdicts.verdict(runs)["text"].endswith("nor had stock 2; rerun with more steps (--steps 21)")


def test_the_cuts_and_the_rule_are_recorded_in_compare_json(tmp_path):
    runs = measured(18)
    result = verdicts.verdict(runs)
    req = CompareRequest(18, None, str(tmp_path / "c.json"), str(tmp_path / "c.png"), False, (), ("t.py",), {})
    data = compare.summary(req, runs, [1.0] * 4, result)
    assert data["warmup"] == "auto" and data["verdict"]["steady"]["rule"] == verdicts.STEADY_RULE
    assert [(r["label"], r["cut"], r["settled"]) for r in data["verdict"]["steady"]["runs"]] == [
        ("stock 1", 7, True),
        ("leantrain 1", 3, True),
        ("leantrain 2", 3, True),
        ("stock 2", 8, True),
    ]
    tokens = 100 * sum(18 - c for c in (3, 3)) / (sum(LEANTRAIN[3:]) * 2 / 1e3)
    assert data["leantrain"]["tokens_per_s"] == pytest.approx(tokens)  # over each run's own timed steps
    fixed = compare.summary(req, runs, [1.0] * 4, verdicts.verdict(runs, 4))
    assert fixed["verdict"]["steady"]["warmup"] == 4 and {r["cut"] for r in fixed["verdict"]["steady"]["runs"]} == {4}


def test_the_table_names_each_runs_cut():
    from leantrain.cli.printing import table

    runs = measured(18)
    text = table(runs, verdicts.verdict(runs))
    assert "untimed start of each run (steps)  7 / 8" in text and text.splitlines()[1].rstrip().endswith("3 / 3")
