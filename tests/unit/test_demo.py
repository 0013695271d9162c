"""``leantrain demo``: four runs (stock, leantrain, leantrain, stock) measured and judged as ``leantrain compare``
does; "nothing applied" when nothing did (no speed claim); GRPO runs train on one recorded set of completions, so
an exact default agrees at every step; the report under its own heading; sizes checked up front; no folders left
behind."""

from __future__ import annotations

import json
import re

import pytest

from leantrain.cli import main
from leantrain.cli import verdict as verdicts
from leantrain.cli._measure import Measurement
from leantrain.cli.demo import NO_VALUE, build_parser, extra_rows


def demo(tmp_path, capsys, *argv: str) -> tuple[dict, str]:
    main(["demo", "--smoke", "--out", str(tmp_path), *argv])
    captured = capsys.readouterr()
    assert "examples/s" not in captured.err  # no progress bars from the datasets library
    return json.loads((tmp_path / "demo.json").read_text()), captured.out


def assert_only_outputs(tmp_path):
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json", "demo.png"]  # no stock/ or leantrain/ folder
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def report_after_the_runs(out: str) -> None:
    """The patch report has its own heading, printed once every run has finished."""
    heading = out.index("== what leantrain applied")
    assert out.index("[4/4] stock:") < heading and out.count("leantrain patch report") == 1


@pytest.mark.slow
def test_default_demo_applies_moe4bit_and_matches_stock(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    summary, out = demo(tmp_path, capsys)
    verdict = summary["verdict"]
    # the grouped 4-bit experts apply (and the fused LM-head loss where its rule takes it): both keep the math
    assert "moe4bit" in verdict["applied"] and "cggr" not in verdict["applied"], out
    assert not verdict["changes_math"] and verdict["losses"]["same"], out
    assert [r["label"] for r in summary["runs"]] == ["stock 1", "leantrain 1", "leantrain 2", "stock 2"]
    assert all(len(r["losses"]) == verdicts.MIN_STEPS for r in summary["runs"])  # --smoke: the fewest steps
    # each run timed from its own steady state: the rule in the header, the cuts in demo.json and in the table
    assert out.startswith("leantrain demo: ") and out.splitlines()[0].endswith(verdicts.STEADY_RULE)
    steady = summary["verdict"]["steady"]
    assert steady["rule"] == verdicts.STEADY_RULE and steady["warmup"] == "auto"
    assert [r["label"] for r in steady["runs"]] == ["stock 1", "leantrain 1", "leantrain 2", "stock 2"]
    assert all(1 <= r["cut"] <= verdicts.MIN_STEPS // 2 for r in steady["runs"])
    assert "untimed start of each run (steps)" in out
    assert re.search(r"^cggr +disabled ", out, re.M) and f"verdict: {verdict['text']}" in out
    assert "differ" not in verdict["text"] and "nothing applied" not in verdict["text"]
    report_after_the_runs(out)
    assert "nan" not in out.split("== measured")[1].lower()
    assert_only_outputs(tmp_path)


@pytest.mark.slow
def test_kill_switch_demo_says_nothing_applied(tmp_path, capsys, monkeypatch):
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("LEANTRAIN_DISABLE", "1")
    summary, out = demo(tmp_path, capsys)
    assert summary["verdict"]["text"] == "nothing applied: no claim"
    assert "faster" not in out and "slower" not in out
    assert summary["verdict"]["applied"] == []


@pytest.mark.slow
def test_grpo_demo_replays_one_set_of_completions(tmp_path, capsys):
    """Every run trains on the completions the first stock run sampled: the losses agree at every step (with
    beta 0 and one iteration TRL's loss value depends on the completions' advantages only)."""
    pytest.importorskip("bitsandbytes")
    # the default GRPO demo's model: on CPU the grouped 4-bit experts are what auto mode applies there
    summary, out = demo(tmp_path, capsys, "--trainer", "grpo")
    verdict = summary["verdict"]
    assert verdict["applied"] == ["moe4bit"], out
    assert all(r["completions"] == ("record" if i == 0 else "replay") for i, r in enumerate(summary["runs"]))
    rewards = [r["metrics"]["reward"] for r in summary["runs"]]
    assert all(r == rewards[0] for r in rewards)  # the same completions, so the same rewards
    assert verdict["losses"]["same"] and "differ" not in verdict["text"]
    assert "trained on the completions the first stock run sampled" in out
    eval_row = next(line for line in out.splitlines() if line.startswith("eval loss"))
    assert NO_VALUE in eval_row and "nan" not in eval_row.lower()
    report_after_the_runs(out)
    assert_only_outputs(tmp_path)


@pytest.mark.slow
def test_cggr_is_behind_its_flag(tmp_path, capsys):
    summary, out = demo(tmp_path, capsys, "--model", "llama", "--cggr")
    assert "cggr" in summary["verdict"]["applied"]
    assert "losses not compared: cggr changes the training math" in summary["verdict"]["text"]
    assert "CGGR is on (opt-in, changes which tokens train)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--smoke", "--hidden", "100"], "--hidden must be a multiple of 64 for --model gpt-oss"),
        (["--smoke", "--model", "llama", "--hidden", "48"], "--hidden must be a multiple of 32 for --model llama"),
        (["--smoke", "--vocab", "100"], "--vocab must be >= 259"),
        (["--smoke", "--experts", "1"], "--experts must be >= 2"),
        (["--smoke", "--seq", "4", "--batch", "0"], "--seq must be >= 8, got 4; --batch must be >= 1, got 0"),
    ],
)
def test_sizes_are_checked_before_anything_runs(tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(tmp_path / "out"), *argv])
    assert message in str(exit_info.value) and str(exit_info.value).startswith("leantrain demo: error:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("steps", ["1", str(verdicts.MIN_STEPS - 1), "x"])
def test_too_few_steps_is_a_parser_error_naming_the_reason(tmp_path, capsys, steps):
    """Below MIN_STEPS the steady-state detection cannot leave out up to half a run and keep MIN_TIMED steps: the
    parser refuses it (exit 2), before anything is built."""
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--smoke", "--out", str(tmp_path / "out"), "--steps", steps])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "leantrain demo: error: argument --steps: " in err
    if steps != "x":
        assert (
            f"must be >= {verdicts.MIN_STEPS}, got {steps}: each run's steady state is detected by leaving out up to "
            f"half of its steps, and a speed claim needs {verdicts.MIN_TIMED} timed steps a run"
        ) in err
    assert not (tmp_path / "out").exists()


def test_every_option_has_help():
    parser = build_parser()
    assert all(action.help for action in parser._actions)
    trainer = next(a for a in parser._actions if a.dest == "trainer")
    assert "GRPOTrainer" in trainer.help


def test_extra_rows_show_no_nan():
    runs = [Measurement(label=m, metrics={"reward": [0.5, None]}) for m in verdicts.ORDER]
    rows = extra_rows(runs, [float("nan"), None, None, float("nan")])
    assert rows[0] == ("eval loss, held-out, all tokens", NO_VALUE, NO_VALUE)
    assert rows[1] == ("reward (mean of last 5 steps)", "0.500", "0.500")
