"""``leantrain compare``: bad input refused before anything runs; the verdict's rules on made-up runs (speed only
outside the measured spread, losses against the derived bound, nothing applied); and end to end over a tiny
Trainer script (tests/unit/_compare_target.py) in child processes: a forced slow path (a sleep injected into every
leantrain step), a forced loss difference, a no-op (the kill switch); the JSON, the PNG, ``--keep`` and
``leantrain run`` reading what ``--keep`` wrote."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from leantrain.cli import _keep, compare, launch
from leantrain.cli import runs as spawn
from leantrain.cli import verdict as verdicts
from leantrain.cli._measure import Measurement


REPO = Path(__file__).resolve().parents[2]
TARGET = str(Path(__file__).with_name("_compare_target.py"))
RUN_TARGET = str(Path(__file__).with_name("_run_target.py"))


def child_env(**extra: str) -> dict[str, str]:
    """The children import this checkout's leantrain, one thread each, and see no LEANTRAIN_* of the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    env.update(extra)
    return env


# --- bad input: exit 2 with a message, before anything runs ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {}, "missing TARGET"),
        (
            ["--steps", str(verdicts.MIN_STEPS - 1), TARGET],
            {},
            f"--steps must be >= {verdicts.MIN_STEPS}, got {verdicts.MIN_STEPS - 1}: each run's steady state is "
            f"detected by leaving out up to half of its steps, and a speed claim needs {verdicts.MIN_TIMED} timed",
        ),
        (
            ["--steps", "4", "--warmup", "2", TARGET],
            {},
            f"--steps 4 leaves 2 timed steps after --warmup 2, and a speed claim needs {verdicts.MIN_TIMED}: give "
            f"--steps >= {2 + verdicts.MIN_TIMED}",
        ),
        (["--warmup", "-1", TARGET], {}, "--warmup must be >= 0 or auto, got -1"),
        (["--warmup", "two", TARGET], {}, "--warmup must be >= 0 or auto, got two"),
        (["--json", f"{TARGET}/out/c.json", TARGET], {}, "is a file, so the folder"),
        (["--plot", str(REPO), TARGET], {}, "is a directory"),
        (["--no-such-flag", TARGET], {}, "unrecognized arguments: --no-such-flag"),
        (["--opt", "cggr_ratio=0.5", TARGET], {}, "unknown option 'cggr_ratio'"),
        (["missing_script.py"], {}, "target 'missing_script.py' not found"),
        ([TARGET], {"RANK": "1", "WORLD_SIZE": "2"}, "outside torchrun / accelerate launch"),
        (["torchrun", "--nproc-per-node", "2", TARGET], {}, "torchrun starts its workers as plain python"),
        (["--measure=x.json", TARGET], {}, "internal option"),
    ],
)
def test_bad_input_exits_2_before_anything_runs(capsys, argv, environ, message):
    with pytest.raises(SystemExit) as exit_info:
        compare.parse(argv, environ=environ)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "leantrain compare: error:" in err, err


def test_unwritable_keep_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / _keep.KEEP_FILE).mkdir()
    with pytest.raises(SystemExit):
        compare.parse(["--keep", TARGET], environ={})
    assert "--keep:" in capsys.readouterr().err


def test_missing_output_folders_are_accepted_and_unwritable_ones_refused(tmp_path, monkeypatch, capsys):
    """--json and --plot into folders that do not exist yet: made when the numbers are written, not refused; a
    folder that cannot be made (its nearest existing folder is not writable) is refused before anything runs."""
    json_path, plot_path = tmp_path / "a" / "b" / "c.json", tmp_path / "d" / "c.png"
    req = compare.parse(["--json", str(json_path), "--plot", str(plot_path), TARGET], environ={})
    assert (req.json_path, req.plot_path) == (str(json_path), str(plot_path))
    assert not (tmp_path / "a").exists()  # nothing made before the runs
    locked = str(tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != locked and real_access(path, mode))
    with pytest.raises(SystemExit) as exit_info:
        compare.parse(["--json", str(json_path), TARGET], environ={})
    assert exit_info.value.code == 2
    assert f"is not writable: {locked!r} is not writable (the folder" in capsys.readouterr().err


def test_python_m_leantrain_compare_reports_bad_input(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "leantrain", "compare", "--steps", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=child_env(),
    )
    assert done.returncode == 2 and "missing TARGET" in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_parse_splits_compare_run_and_target_options():
    req = compare.parse(
        ["--steps=6", "--cggr", "--opt", "cggr_scoring=margin", "--warmup", "1", TARGET, "--steps", "9", "--keep"],
        environ={},
    )
    assert (req.steps, req.warmup, req.keep) == (6, 1, False)
    assert compare.parse([TARGET], environ={}).warmup is None  # auto: each run's steady state is detected
    assert req.run_options == ("--cggr", "--opt", "cggr_scoring=margin")
    assert req.target == (TARGET, "--steps", "9", "--keep")
    assert req.options == {"cggr": True, "cggr_scoring": "margin"}
    module = compare.parse(["-m", "tests.unit._compare_target", "--out", "x"], environ={})
    assert module.target == ("-m", "tests.unit._compare_target", "--out", "x")


# --- the verdict's rules, on made-up runs ------------------------------------------------------------------------


def run(label: str, step_ms, losses=None, applied=(), peak=1000, dtype="fp32", layers=2, **kw) -> Measurement:
    n = len(step_ms)
    losses = list(losses) if losses is not None else [5.0 - 0.1 * k for k in range(n)]
    return Measurement(
        label=label,
        steps=list(range(1, n + 1)),
        step_ms=list(step_ms),
        losses=losses,
        tokens=[100] * n,
        peak_bytes=peak,
        applied=list(applied),
        dtype=dtype,
        layers=layers,
        **kw,
    )


def four(stock_ms, lean_ms, lean_losses=None, applied=("moe4bit",), **kw) -> list[Measurement]:
    """ORDER: stock, leantrain, leantrain, stock."""
    return [
        run("stock 1", stock_ms[0], **kw),
        run("leantrain 1", lean_ms[0], lean_losses, applied, **kw),
        run("leantrain 2", lean_ms[1], lean_losses, applied, **kw),
        run("stock 2", stock_ms[1], **kw),
    ]


WARM = [500.0, 400.0]  # two warm-up steps, left out


def test_faster_needs_separated_spreads_and_every_run_ahead():
    runs = four([WARM + [100, 102, 98, 101], WARM + [99, 103, 100, 100]], [WARM + [70, 71, 69, 72]] * 2)
    result = verdicts.verdict(runs)
    assert result["speed"]["verdict"] == "faster" and result["text"].startswith("faster by 1.4")
    assert re.search(r"same losses \(max diff 0\.0e\+00, bound \d\.\de-0\d at that step\)$", result["text"])
    assert result["helped"]
    # one leantrain run as slow as stock: not every run is ahead, and the two leantrain runs disagree
    mixed = four([WARM + [100, 102, 98, 101]] * 2, [WARM + [70, 71, 69, 72], WARM + [101, 100, 99, 102]])
    assert verdicts.verdict(mixed)["text"].startswith("no claim: the two leantrain runs disagree (70.5 vs 100.5")


def test_the_first_step_counts_with_its_payback():
    """The first leantrain launch's first step, when slower than every stock run's (compiling), is named with the
    steps the saving needs to pay it back; the second launch's (the caches the first filled) is told apart; one
    within noise of stock's is not named; without a saving nothing pays it back."""
    stock = [[500.0, 400, 100, 102, 98, 101], [520.0, 400, 99, 103, 100, 100]]
    lean = [[12500.0, 400, 70, 71, 69, 72], [13100.0, 400, 70, 71, 69, 72]]
    result = verdicts.verdict(four(stock, lean), 2)
    first = result["first_step"]
    assert first["stock_ms"] == [500.0, 520.0] and first["leantrain_ms"] == [12500.0, 13100.0]
    extra, saved = 12500.0 - 510.0, 100.0 - 70.5  # over stock's median first step; pooled timed steps' medians
    assert first["extra_ms"] == extra and first["payback_steps"] == math.ceil(extra / saved) == 407
    assert first["second_launch_extra_ms"] == 13100.0 - 510.0
    assert result["text"].endswith(
        "; the first step took 12.0 s longer (once: compiling, set-up), paid back after 407 steps; 12.6 s longer on "
        "the second launch (caches warm from the first)"
    )
    warm = verdicts.verdict(four(stock, [lean[0], [540.0, 400, 70, 71, 69, 72]]), 2)  # within 10% of stock: noise
    assert warm["first_step"]["second_launch_extra_ms"] == 0.0
    assert warm["text"].endswith("steps; on the second launch (caches warm from the first) no longer than stock's")
    fast_first = verdicts.verdict(four(stock, [[300.0, 400, 70, 71, 69, 72], lean[1]]), 2)
    assert fast_first["first_step"]["extra_ms"] == 0.0 and "the first step took" not in fast_first["text"]
    assert fast_first["text"].endswith("; 12.6 s longer on the second launch (caches warm from the first)")
    close = verdicts.verdict(four(stock, [[540.0, 400, 70, 71, 69, 72], [545.0, 400, 70, 71, 69, 72]]), 2)
    assert close["first_step"]["extra_ms"] == 0.0 and "first step" not in close["text"]  # under 10%: noise
    assert "second launch" not in close["text"]
    same = four([WARM + [100, 101, 99, 100]] * 2, [[9000.0, 400, 100, 101, 99, 100]] * 2)
    text = verdicts.verdict(same)["text"]
    assert text.endswith(
        "took 8.5 s longer (once: compiling, set-up), and no measured step-time saving pays it back; 8.5 s longer on "
        "the second launch (caches warm from the first)"
    ), text


def test_a_one_off_cost_below_a_second_is_in_ms_and_one_below_the_tables_precision_is_not_named():
    stock, lean = [100.0, 101, 99, 100, 101, 100], [70.0, 71, 69, 70, 71, 70]

    def firsts(stock_first, lean_first):
        return four([[s, *stock[1:]] for s in stock_first], [[s, *lean[1:]] for s in lean_first])

    result = verdicts.verdict(firsts((500.0, 520.0), (800.0, 830.0)), 1)
    assert result["first_step"]["extra_ms"] == pytest.approx(290.0)
    assert result["text"].endswith(
        "; the first step took 290.0 ms longer (once: compiling, set-up), paid back after 10 steps; 320.0 ms longer "
        "on the second launch (caches warm from the first)"
    )
    tiny = verdicts.verdict(firsts((0.30, 0.31), (0.35, 0.35)), 1)
    assert 0 < tiny["first_step"]["extra_ms"] < 0.05 and "first step" not in tiny["text"]
    assert "second launch" not in tiny["text"]


def test_the_largest_loss_difference_is_shown_with_its_own_steps_bound():
    """Not the run's smallest bound (step 1's, before the loss moved): that would read as if the diff broke it."""
    losses = [5.0, 4.0, 5.0, 4.0, 5.0, 4.0]  # the moved term grows the bound step by step
    lean = [*losses[:4], 5.0 + 3e-6, 4.0]
    fast, slow = WARM + [70, 71, 69, 72], WARM + [100, 102, 98, 101]
    runs = [run("stock 1", slow, losses), run("leantrain 1", fast, lean, ("moe4bit",))]
    runs += [run("leantrain 2", fast, lean, ("moe4bit",)), run("stock 2", slow, losses)]
    result = verdicts.verdict(runs)
    check = result["losses"]
    assert check["diff"].index(max(check["diff"])) == 4 and check["bound"][4] > 1.5 * check["bound"][0]
    assert result["text"].endswith(f"(max diff {check['diff'][4]:.1e}, bound {check['bound'][4]:.1e} at that step)")


def test_overlapping_spreads_are_no_claim_even_with_a_different_median():
    runs = four([WARM + [100, 140, 90, 130]] * 2, [WARM + [95, 125, 85, 120]] * 2)
    result = verdicts.verdict(runs)
    assert result["speed"]["ratio"] > 1.04  # stock's median is higher ...
    assert result["text"] == "within noise: no claim" and not result["helped"]  # ... inside the spread


def test_slower_and_leaner():
    runs = four([WARM + [100, 101, 99, 100]] * 2, [WARM + [150, 151, 149, 152]] * 2)
    assert verdicts.verdict(runs)["text"].startswith("slower by 1.5")
    lean = four([WARM + [100, 101, 99, 100]] * 2, [WARM + [100, 101, 99, 100]] * 2)
    for r in lean[1:3]:
        r.peak_bytes = 800
    result = verdicts.verdict(lean)
    assert result["text"].startswith("step time within noise, 20% less peak memory, same losses (max diff")
    assert result["helped"] and result["keep"] == "helped"


def test_nothing_applied_is_never_a_claim():
    runs = four([WARM + [100, 101, 99, 100]] * 2, [WARM + [50, 51, 49, 50]] * 2, applied=())
    result = verdicts.verdict(runs)
    assert result["speed"]["verdict"] == "faster"  # what the clock alone says ...
    assert result["text"] == "nothing applied: no claim" and not result["helped"]  # ... is not a claim


def test_losses_differ_names_the_step_where_they_split():
    losses = [5.0, 4.9, 4.8 + 1e-3, 4.7]
    runs = four([WARM + [100, 101, 100.5]] * 2, [WARM + [50, 51, 50.5]] * 2, lean_losses=losses)
    result = verdicts.verdict(runs, 2)
    assert result["losses"]["split_step"] == 3 and result["text"] == "losses differ from step 3: no claim"
    # a math-changing optimization (CGGR) is not held to the bound
    runs = four([WARM + [100, 101, 100.5]] * 2, [WARM + [50, 51, 50.5]] * 2, losses, ("cggr",), changes_math=["cggr"])
    assert verdicts.verdict(runs, 2)["text"].startswith("faster by 1.99x (losses not compared: cggr")


def test_grad_norm_and_entropy_are_held_to_the_same_rule():
    """GRPO with beta 0: the loss value is the advantages' alone; what the log-probs change shows in grad_norm."""
    runs = four([WARM + [100, 101, 100.5]] * 2, [WARM + [50, 51, 50.5]] * 2)
    for r in runs:
        r.metrics = {"grad_norm": [1.0, 1.1, 1.2, 1.3], "entropy": [6.0, 6.0, 6.0, 6.0]}
    assert verdicts.verdict(runs, 2)["text"].startswith("faster by 1.99x, same losses (max diff")
    for r in runs[1:3]:
        r.metrics = {**r.metrics, "grad_norm": [1.0, 1.1, 1.25, 1.3]}
    result = verdicts.verdict(runs, 2)
    assert result["text"] == "grad_norm differs from step 3: no claim" and not result["helped"]
    assert result["metrics"]["entropy"]["same"]


def test_stock_runs_that_applied_something_are_no_claim():
    runs = four([WARM + [100, 101, 100.5]] * 2, [WARM + [50, 51, 50.5]] * 2)
    runs[0].applied = ["cggr"]
    assert "despite the kill switch" in verdicts.verdict(runs, 2)["text"]


def test_loss_bound_is_derived_from_the_unit_roundoff_and_the_loss():
    """8·u·√(2L+2)·(|loss| + Σ|Δloss|): at step 1 the parity suite's one-forward bound, then the loss's movement."""
    rel = 8 * 2.0**-24 * math.sqrt(2 * 2 + 2)
    assert verdicts.loss_bounds([4.0, 3.0, 3.5], "fp32", 2) == pytest.approx(
        [rel * 4, rel * (3 + 1), rel * (3.5 + 1.5)]
    )
    assert verdicts.loss_bounds([4.0], "bf16", 2)[0] == pytest.approx(8 * 2.0**-8 * math.sqrt(6) * 4)
    assert verdicts.loss_bounds([1.0], "fp32", None)[0] == pytest.approx(8 * 2.0**-24 * math.sqrt(66))  # L = 32


def test_run_to_run_spread_widens_the_bound():
    """A nondeterministic stack (stock differs from stock): leantrain may differ from stock by twice as much."""
    stock = [[5.0, 4.0], [5.0, 4.0 + 1e-3]]
    lean = [[5.0, 4.0 + 1.5e-3]] * 2
    check = verdicts.loss_check(stock, lean, "fp32", 2)
    assert check["same"] and check["bound"][1] > 2e-3
    assert not verdicts.loss_check([[5.0, 4.0]] * 2, lean, "fp32", 2)["same"]


def test_keep_decisions():
    req = compare.parse(["--cggr", TARGET], environ={})
    helped = {"applied": ["moe4bit", "cggr"], "changes_math": ["cggr"], "helped": True, "keep": "helped"}
    assert _keep.decisions(req.options, helped) == {"moe4bit": None, "cggr": True}
    assert _keep.decisions(req.options, {**helped, "keep": "hurt"}) == {"moe4bit": False, "cggr": False}
    assert _keep.decisions(req.options, {**helped, "keep": None}) == {}  # no claim: nothing is kept


def test_a_noise_verdict_keeps_nothing():
    """Overlapping spreads, or runs that disagree, make no claim: --keep must not turn anything off from them."""
    noise = verdicts.verdict(four([WARM + [100, 140, 90, 130]] * 2, [WARM + [95, 125, 85, 120]] * 2), 2)
    busy = verdicts.verdict(four([WARM + [100, 101, 100], WARM + [900, 905, 910]], [WARM + [150, 151, 150]] * 2), 2)
    for result in (noise, busy):
        assert result["keep"] is None and _keep.decisions({}, result) == {}


# --- a busy machine: no claim, and the cause named ---------------------------------------------------------------


def test_one_disturbed_stock_run_is_no_claim_with_the_cause():
    """A neighbour slows one stock run 9x: pooled, leantrain looks faster; the stock runs disagree, so no claim."""
    runs = four([WARM + [100, 101, 99, 100], WARM + [900, 905, 910, 899]], [WARM + [98, 99, 97, 98]] * 2)
    result = verdicts.verdict(runs)
    assert result["speed"]["verdict"] == "no claim" and not result["helped"]
    assert result["text"].startswith("no claim: the two stock runs disagree (100.0 vs 902.5 ms a step")
    assert "something else on the machine slowed stock 2" in result["text"]
    # the ratio of the run medians is recorded, but no claim is made from it
    assert result["speed"]["ratio"] == pytest.approx(501.25 / 98.0)


def test_runs_that_agree_within_their_own_spread_still_claim():
    runs = four([WARM + [100, 101, 99, 100], WARM + [106, 107, 105, 106]], [WARM + [70, 71, 69, 72]] * 2)
    assert verdicts.verdict(runs)["text"].startswith("faster by 1.4")


def test_a_disagreement_far_smaller_than_the_effect_still_claims():
    """Stock runs 40% apart on a busy machine, leantrain 10x faster than either: the disagreement cannot make it."""
    runs = four([WARM + [100, 101, 99, 100], WARM + [140, 141, 139, 140]], [WARM + [10, 10.1, 9.9, 10]] * 2)
    assert verdicts.verdict(runs)["text"].startswith("faster by 12.0")
    # the same disagreement against a 1.5x effect is no claim
    close = four([WARM + [100, 101, 99, 100], WARM + [140, 141, 139, 140]], [WARM + [80, 81, 79, 80]] * 2)
    assert verdicts.verdict(close)["text"].startswith("no claim: the two stock runs disagree (100.0 vs 140.0")


def test_a_loaded_host_is_no_claim_when_the_load_could_explain_the_ratio():
    loaded = dict(host_load=[6.0] * 6, cores=2)  # 3 runnable threads a core: steps can take 3x as long
    runs = four([WARM + [100, 101, 99, 100]] * 2, [WARM + [70, 71, 69, 72]] * 2, **loaded)
    result = verdicts.verdict(runs)
    assert result["text"].startswith("no claim: the host was loaded during stock 1 (host load average up to 6.0")
    assert "up to 3.0x, more than the 1.42x measured" in result["text"] and result["keep"] is None
    # a difference well beyond what the load explains (a 10x slower path) is still a claim
    slow = four([WARM + [100, 101, 99, 100]] * 2, [WARM + [1000, 1001, 999, 1002]] * 2, **loaded)
    assert verdicts.verdict(slow)["text"].startswith("slower by 10.0")


def test_no_claim_from_fewer_timed_steps_and_the_cap_is_named():
    runs = four([WARM + [100]] * 2, [WARM + [50]] * 2, requested_steps=5, max_steps=3)
    result = verdicts.verdict(runs, 2)
    assert result["text"] == (
        "no claim: 1 timed step a run, and a speed claim needs at least 3; the script capped its runs at "
        "max_steps=3 (5 steps asked for)"
    )
    assert result["capped"].startswith("the script capped")


def test_warmup_warning_names_the_option_that_shortens_it():
    req = compare.parse(["--steps", "10", "--cggr", TARGET], environ={})
    text = compare.warmup_warning(req, ["cggr"], {})
    assert "inside CGGR's warm-up (100 steps" in text and "--opt cggr_warmup_steps=0" in text
    short = compare.parse(["--cggr", "--opt", "cggr_warmup_steps=0", TARGET], environ={})
    assert compare.warmup_warning(short, ["cggr"], {}) is None
    assert compare.warmup_warning(req, ["fused_ce"], {}) is None


def test_kept_is_a_layer_of_its_own_below_the_environment():
    from leantrain.config import resolve_config

    cfg = resolve_config({}, {"LEANTRAIN_OSFT": "0"}, cli={"moe4bit": True}, kept={"cggr": True, "osft": True})
    assert (cfg.config.cggr, cfg.sources["cggr"]) == (True, "kept")
    assert (cfg.config.osft, cfg.sources["osft"]) == (False, "env") and cfg.sources["moe4bit"] == "cli"


def test_kept_options_apply_only_to_the_measured_target(tmp_path):
    other = tmp_path / "other.py"
    other.write_text("")
    path = str(tmp_path / "k.json")
    _keep.write({"fused_ce": False}, {"verdict": "slower by 1.5x", "target": [TARGET, "--out", "x"]}, path)
    said: list[str] = []
    got = _keep.with_kept({}, {}, path, said.append, target=(TARGET,))
    assert got == {"fused_ce": False} and "from the verdict: slower by 1.5x" in said[-1]
    assert _keep.with_kept({}, {}, path, said.append, target=(str(other),)) == {}
    assert "not read: it was measured on" in said[-1]
    assert _keep.with_kept({}, {}, path, said.append, target=("-m", "pkg.train")) == {}


# --- leantrain run reads what --keep wrote -----------------------------------------------------------------------


def test_kept_options_rank_below_the_command_line_and_the_environment(tmp_path):
    path = str(tmp_path / _keep.KEEP_FILE)
    _keep.write({"cggr": True, "moe4bit": False}, {"verdict": "x"}, path)
    notes: list[str] = []
    assert _keep.with_kept({}, {}, path, notes.append) == {"cggr": True, "moe4bit": False}
    assert "cggr=True, moe4bit=False" in notes[0]
    assert _keep.with_kept({"cggr": False}, {}, path, notes.append) == {"cggr": False, "moe4bit": False}
    assert _keep.with_kept({}, {"LEANTRAIN_MOE4BIT": "1"}, path, notes.append) == {"cggr": True}
    assert _keep.with_kept({}, {"LEANTRAIN_DISABLE": "1"}, path, notes.append) == {}
    assert "kill switch" in notes[-1]
    assert _keep.with_kept({"disable": "1"}, {}, path, notes.append) == {"disable": "1"}  # --opt disable=1
    assert "kill switch" in notes[-1]


def test_a_record_of_a_past_run_is_not_read(tmp_path):
    """save_model() writes leantrain.json too: its options (source kwarg / env / default) are not decisions."""
    path = tmp_path / _keep.KEEP_FILE
    path.write_text(json.dumps({"options": {"cggr": {"value": True, "source": "env"}}}))
    assert _keep.read(str(path)) == {}
    _keep.write({"moe4bit": None}, {}, str(path))
    saved = json.loads(path.read_text())
    assert saved["options"] == {
        "cggr": {"value": True, "source": "env"},
        "moe4bit": {"value": "auto", "source": "compare"},
    }
    assert _keep.read(str(path)) == {"moe4bit": "auto"}


def test_leantrain_run_applies_the_kept_options(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for var in [v for v in os.environ if v.startswith("LEANTRAIN_")]:
        monkeypatch.delenv(var)
    kept_for = {"verdict": "faster by 1.5x, same losses", "target": [RUN_TARGET, "--out", "elsewhere"]}
    _keep.write({"cggr": True}, kept_for)
    assert launch.main([RUN_TARGET, "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "result_rank0.json").read_text())["report"]
    cggr = next(o for o in report["outcomes"] if o["name"] == "cggr")
    assert cggr["status"] == "applied" and cggr["source"] == "kept"  # its own source, not the command line's
    err = capsys.readouterr().err
    assert "options kept by leantrain compare" in err and "(from the verdict: faster by 1.5x, same losses)" in err


# --- the GPU recipe target's smoke mode (benchmarks/compare_recipe.py) ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["moe_qlora", "sft"])
def test_recipe_target_smoke_trains_under_leantrain_run(recipe, tmp_path, monkeypatch, capsys):
    if recipe == "moe_qlora":
        pytest.importorskip("bitsandbytes")
    monkeypatch.chdir(tmp_path)
    script = str(REPO / "benchmarks" / "compare_recipe.py")
    # on CPU auto mode keeps the stock experts at the smoke shape (4 experts a layer: not measured faster there)
    flags = ["--moe4bit"] if recipe == "moe_qlora" else []
    assert launch.main([*flags, script, recipe, "--smoke", "--steps", "2"]) == 0
    err = capsys.readouterr().err
    assert bool(re.search(r"^moe4bit +applied ", err, re.M)) == (recipe == "moe_qlora"), err[-2000:]


# --- end to end: four child processes over a tiny Trainer script --------------------------------------------------


def compare_run(
    tmp: Path, argv: list[str], env: dict[str, str], sleep_ms=None, json_path: Path | None = None
) -> tuple[dict, str]:
    cwd = os.getcwd()
    os.chdir(tmp)  # --keep writes ./leantrain.json
    try:
        outputs = ["--json", str(json_path or tmp / "c.json"), "--plot", str(tmp / "c.png")]
        req = compare.parse([*outputs, *argv], environ=env)
        lines: list[str] = []
        data = compare.compare(req, out=lines.append, environ=env, sleep_ms=sleep_ms)
    finally:
        os.chdir(cwd)
    return data, "\n".join(lines)


@pytest.fixture(scope="module")
def slow_path(tmp_path_factory):
    """CGGR applied (in its warm-up: every label trains), a 1 s sleep inside every leantrain step and 0.3 s inside
    every stock one (so that the tiny model's own noisy milliseconds cannot move a run's step time), timed from each
    run's detected steady state (the default)."""
    tmp = tmp_path_factory.mktemp("compare_slow")
    argv = ["--steps", str(verdicts.MIN_STEPS), "--keep", "--cggr", "--opt", "cggr_warmup_steps=1000"]
    sleep = {"leantrain": 1000.0, "stock": 300.0}
    data, out = compare_run(tmp, [*argv, TARGET, "--out", str(tmp / "target")], child_env(), sleep)
    return tmp, data, out


@pytest.mark.slow
def test_forced_slow_path_is_slower(slow_path):
    tmp, data, out = slow_path
    verdict = data["verdict"]
    assert verdict["speed"]["verdict"] == "slower", out
    assert verdict["text"].startswith("slower by") and "losses not compared: cggr" in verdict["text"]
    assert "cggr" in verdict["applied"] and f"verdict: {verdict['text']}" in out
    assert "== what leantrain applied" in out and re.search(r"^cggr +applied ", out, re.M)
    assert f"{verdicts.MIN_STEPS} steps per run, {verdicts.STEADY_RULE}" in out  # the rule, stated


@pytest.mark.slow
def test_json_holds_both_modes_and_the_verdict(slow_path):
    tmp, data, _ = slow_path
    saved = json.loads((tmp / "c.json").read_text())
    assert saved["order"] == ["stock", "leantrain", "leantrain", "stock"]
    for mode in ("stock", "leantrain"):
        got = saved[mode]
        assert len(got["step_ms"]) == len(got["losses"]) == len(got["tokens"]) == len(got["peak_bytes"]) == 2
        assert all(len(run) == verdicts.MIN_STEPS for run in (*got["step_ms"], *got["losses"], *got["tokens"]))
        assert all(isinstance(p, int) and p > 0 for p in got["peak_bytes"])
        assert all(t == 32 for run in got["tokens"] for t in run)  # 2 rows x 16 tokens per step
        assert got["report"]["trainer_kind"] == "trainer"
    stock_cggr = next(o for o in saved["stock"]["report"]["outcomes"] if o["name"] == "cggr")
    assert stock_cggr["status"] == "disabled" and "LEANTRAIN_DISABLE=1" in stock_cggr["reasons"][0]
    assert saved["stock"]["losses"][0] == saved["stock"]["losses"][1]  # deterministic on CPU
    assert min(saved["leantrain"]["step_ms"][0][1:]) >= 1000  # the injected sleep is inside the step
    assert saved["verdict"]["text"] == data["verdict"]["text"]
    assert saved["warmup"] == "auto" and saved["verdict"]["steady"]["rule"] == verdicts.STEADY_RULE
    cuts = [r["cut"] for r in saved["verdict"]["steady"]["runs"]]
    assert all(1 <= c <= verdicts.MIN_STEPS // 2 for c in cuts), cuts


@pytest.mark.slow
def test_png_and_no_files_of_the_target(slow_path):
    tmp, _, _ = slow_path
    assert (tmp / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp / "c.png").stat().st_size > 10_000
    written = [p for p in (tmp / "target").rglob("*")] if (tmp / "target").exists() else []
    assert not written, written  # no save_steps=1 checkpoints (the Trainer may make the empty output_dir)


@pytest.mark.slow
def test_keep_turns_off_what_did_not_help(slow_path):
    tmp, data, out = slow_path
    kept = json.loads((tmp / _keep.KEEP_FILE).read_text())
    applied = data["verdict"]["applied"]  # cggr (on CPU nothing else applies to this tiny Trainer by default)
    assert kept["options"] == {name: {"value": False, "source": "compare"} for name in applied}
    assert kept["compare"]["verdict"].startswith("slower by") and kept["compare"]["target"][0] == TARGET
    listed = ", ".join(f"{n}=False" for n in applied)
    assert f"kept in ./leantrain.json for leantrain run on {os.path.abspath(TARGET)} only: {listed}" in out


@pytest.mark.slow
def test_forced_loss_difference(tmp_path):
    # --fused-ce: on CPU auto mode applies nothing to this tiny Trainer (nothing measured faster there)
    argv = ["--steps", "4", "--warmup", "1", "--fused-ce", TARGET, "--out", str(tmp_path / "t"), "--differ"]
    data, out = compare_run(tmp_path, argv, child_env())
    assert data["verdict"]["text"] == "losses differ from step 2: no claim", out
    diff, bound = data["verdict"]["losses"]["diff"], data["verdict"]["losses"]["bound"]
    assert diff[0] <= bound[0] and diff[1] > bound[1]  # step 1 is before any update: the defaults keep the math


@pytest.mark.slow
def test_kill_switch_is_nothing_applied(tmp_path):
    """Also: --json into folders that do not exist yet makes them."""
    json_path = tmp_path / "new" / "folder" / "c.json"
    data, out = compare_run(
        tmp_path,
        ["--steps", "4", "--warmup", "1", TARGET, "--out", str(tmp_path / "t")],
        child_env(LEANTRAIN_DISABLE="1"),
        json_path=json_path,
    )
    assert data["verdict"]["text"].startswith("nothing applied: no claim (stopped after the first leantrain run"), out
    assert data["order"] == ["stock", "leantrain"] and len(data["run_wall_s"]) == 2  # the other two never ran
    assert json.loads(json_path.read_text())["verdict"] == data["verdict"]


@pytest.mark.slow
def test_the_fused_loss_on_a_plain_trainer_keeps_the_losses(tmp_path):
    """The fused LM-head loss on a plain Trainer (asked for: on CPU auto mode keeps the stock loss, not measured
    faster there) keeps the math: the verdict holds its losses to the bound at every step and never says they
    differ, nor that nothing applied."""
    argv = ["--steps", "4", "--warmup", "1", "--fused-ce", TARGET, "--out", str(tmp_path / "t")]
    data, out = compare_run(tmp_path, argv, child_env())
    verdict = data["verdict"]
    assert "fused_ce" in verdict["applied"] and not verdict["changes_math"], out
    assert verdict["losses"]["same"] and verdict["losses"]["compared_steps"] == 4, out
    assert "differ" not in verdict["text"] and "nothing applied" not in verdict["text"], out
    assert all(d <= b for d, b in zip(verdict["losses"]["diff"], verdict["losses"]["bound"]))
    assert data["stock"]["applied"] == []  # stock is the kill switch: nothing patched


def test_tokens_are_counted_from_a_batch_encoding():
    """A plain Trainer's collators (DataCollatorWithPadding and the like) hand over a BatchEncoding, not a dict."""
    import torch
    from transformers import BatchEncoding

    from leantrain.cli._measure import StepMeter

    meter = StepMeter(1)
    batch = BatchEncoding(
        {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])}
    )
    meter._add_tokens(batch)
    meter._add_tokens({"input_ids": torch.ones(1, 4, dtype=torch.long)})  # no mask: every position
    assert int(meter._inputs_tokens) == 8 + 4


def test_stock_runs_get_none_of_the_run_options():
    """A flag such as --cggr overrides LEANTRAIN_DISABLE=1 (an explicit request): the stock runs must not get it."""
    req = compare.parse(["--cggr", "--opt", "cggr_scoring=margin", TARGET, "--out", "x"], environ={})
    stock = spawn._child_command(req, "stock", "spec.json")
    lean = spawn._child_command(req, "leantrain", "spec.json")
    assert stock[stock.index("run") + 1 :] == ["--measure=spec.json", "--", TARGET, "--out", "x"]
    assert lean[lean.index("run") + 1 :] == [*req.run_options, "--measure=spec.json", "--", TARGET, "--out", "x"]


@pytest.mark.slow
def test_a_disturbed_stock_run_is_no_claim_with_the_cause(tmp_path):
    """One stock run slowed by a sleep in its every step (a neighbour on the machine): pooled, leantrain would look
    faster; the two stock runs disagree, so the verdict makes no claim, names the cause, and --keep keeps nothing.
    Every other step sleeps 0.3 s, so that the tiny model's own noisy milliseconds cannot move a run's step time."""
    data, out = compare_run(
        tmp_path,
        ["--steps", "4", "--warmup", "1", "--keep", "--fused-ce", TARGET, "--out", str(tmp_path / "t")],
        child_env(),
        {"stock 2": 1300.0, "stock 1": 300.0, "leantrain": 300.0},
    )
    verdict = data["verdict"]
    assert verdict["speed"]["verdict"] == "no claim", out
    assert verdict["text"].startswith("no claim: the two stock runs disagree"), out
    assert "something else on the machine slowed stock 2" in verdict["text"]
    assert min(data["stock"]["step_ms"][1][1:]) >= 1000  # the sleep is inside the second stock run's steps
    assert all(len(run) == 4 for run in data["stock"]["step_cpu_ms"] + data["stock"]["host_load"])
    assert "nothing kept in ./leantrain.json: the verdict made no claim" in out
    assert not (tmp_path / _keep.KEEP_FILE).exists()


def test_a_failed_launch_names_the_rank_error_above_the_launcher_report(tmp_path):
    """Under accelerate/torchrun the log ends in the launcher's traceback (a signal, no cause): the message brings
    the rank's own error line along; a plain tail is left as it is."""
    from leantrain.cli import runs

    launcher = ["Traceback (most recent call last):\n"]
    launcher += [f'  File "/x/torch/distributed/run.py", line {k}, in run\n' for k in range(30)]
    launcher += ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"]
    log = tmp_path / "run.log"
    log.write_text("{'loss': '7.6'}\nterminate called without an active exception\n" + "".join(launcher))
    message = runs._tail(str(log))
    assert message.startswith("first error above these lines: terminate called without an active exception\n")
    assert message.endswith("ChildFailedError:\n")
    log.write_text("step 1\nValueError: bad batch\n")
    assert runs._tail(str(log)) == "step 1\nValueError: bad batch\n"


_MEASURED_THEN_ABORT = """
import json, sys
from leantrain.cli._measure import Measurement, MeasureSpec
spec = MeasureSpec.load(sys.argv[1])
with open(spec.out, "w") as handle:
    json.dump(Measurement(label=spec.label, steps=[1, 2], step_ms=[10.0, 11.0]).to_json(), handle)
print("terminate called without an active exception", flush=True)
sys.exit(134)
"""


@pytest.mark.parametrize("measured", [True, False])
def test_a_run_exiting_with_an_error_after_its_steps_were_measured_is_kept_with_the_cause(
    measured, tmp_path, monkeypatch
):
    """A rank aborting in a library's teardown once training is over (DeepSpeed on CPU has): the measurement is
    complete, so compare keeps it and says how the process ended; without a measurement the run failed."""
    import io

    script = _MEASURED_THEN_ABORT if measured else "import sys; print('ValueError: bad batch'); sys.exit(1)"
    command = lambda req, mode, spec_path: [sys.executable, "-c", script, spec_path]  # noqa: E731
    monkeypatch.setattr(spawn, "_child_command", command)
    req = compare.parse(["--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png"), TARGET], environ={})
    workdir = tmp_path / "runs"
    workdir.mkdir()
    stream = io.StringIO()
    call = lambda: spawn.run_one(req, 0, "stock", str(workdir), spawn.Progress(stream), dict(os.environ))  # noqa: E731
    if not measured:
        with pytest.raises(spawn.RunFailed, match="ValueError: bad batch"):
            call()
        return
    result, _ = call()
    assert result.step_ms == [10.0, 11.0]
    assert result.exit_note.startswith("exited 134 after its steps were measured (terminate called without")
    assert (tmp_path / "run1-stock.log").exists()  # kept beside the JSON
    assert "exited 134 after its steps were measured" in stream.getvalue()


# --- the runs' temporary folder: removed however compare ends -------------------------------------------------------


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """tempfile's folder for this test only: what compare leaves behind shows up here."""
    import tempfile

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def quiet() -> spawn.Progress:
    import io

    return spawn.Progress(io.StringIO())


@pytest.mark.parametrize("ending", ["success", "a run failing", "KeyboardInterrupt"])
def test_the_runs_folder_is_removed_however_compare_ends(temp_root, tmp_path, monkeypatch, ending):
    req = compare.parse(["--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png"), TARGET], environ={})
    started: list[str] = []

    def run_one(req, index, mode, workdir, progress, environ, sleep_ms):
        started.append(workdir)
        for name in (f"run{index + 1}.spec.json", f"run{index + 1}-{mode}.log", "completions.pt"):
            Path(workdir, name).write_text("x")
        if index == 1 and ending != "success":
            raise spawn.RunFailed("the leantrain 1 run failed") if ending == "a run failing" else KeyboardInterrupt
        return Measurement(label=mode, applied=["fused_ce"]), 0.0

    monkeypatch.setattr(spawn, "run_one", run_one)
    if ending == "success":
        runs, _ = spawn.run_all(req, progress=quiet(), environ={})
        assert len(runs) == 4
    else:
        with pytest.raises(spawn.RunFailed if ending == "a run failing" else KeyboardInterrupt):
            spawn.run_all(req, progress=quiet(), environ={})
    assert started and all(str(Path(w).parent) == str(temp_root) for w in started)
    assert list(temp_root.iterdir()) == []


def test_a_failed_run_keeps_its_log_beside_the_json_and_nothing_in_the_temporary_folder(temp_root, tmp_path):
    env = child_env()
    out = tmp_path / "results"
    out.mkdir()
    argv = ["--json", str(out / "c.json"), "--plot", str(out / "c.png"), TARGET]  # no --out: the target exits 2
    req = compare.parse(argv, environ=env)
    with pytest.raises(spawn.RunFailed) as failed:
        spawn.run_all(req, progress=quiet(), environ=env)
    log = out / "run1-stock.log"
    assert f"the stock 1 run failed (exit 2); its output is in {log}; last lines:" in str(failed.value)
    assert "the following arguments are required: --out" in log.read_text()
    assert list(temp_root.iterdir()) == []


def test_an_interrupted_compare_stops_its_run_and_removes_the_folder(temp_root, tmp_path, monkeypatch):
    env = child_env()
    req = compare.parse(
        ["--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png"), TARGET, "--out", str(tmp_path / "t")],
        environ=env,
    )
    children: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            children.append(self)

    real_sleep, calls = spawn.time.sleep, []

    def interrupted(seconds):  # the time module's own: Popen.wait(timeout) sleeps through it too
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C while the first run starts
        real_sleep(seconds)

    monkeypatch.setattr(spawn.subprocess, "Popen", Recorded)
    monkeypatch.setattr(spawn.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        spawn.run_all(req, progress=quiet(), environ=env)
    assert len(children) == 1 and children[0].returncode is not None  # ended, not left training
    assert list(temp_root.iterdir()) == [] and not (tmp_path / "run1-stock.log").exists()
