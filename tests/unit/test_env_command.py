"""`leantrain env` checks every LEANTRAIN_* variable exactly as `leantrain run` and patch_trainer do (the same
message, a non-zero exit) and lists the ones set with the values they parse to."""

from __future__ import annotations

import subprocess
import sys

import pytest

from leantrain.cli import launch, main
from leantrain.config import OPTIMIZATIONS, resolve_config


BAD = [
    {"LEANTRAIN_CGGR": "maybe"},
    {"LEANTRAIN_FOO": "1"},
    {"LEANTRAIN_CGGR_MIN_TOKENS_RATIO": "1.5"},
    {"LEANTRAIN_STRICT": "sometimes"},
    {"LEANTRAIN_CGGR_ROUTER_LAYERS": "two"},
]


@pytest.mark.parametrize("environ", BAD, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_env_rejects_what_run_and_patch_trainer_reject_with_the_same_message(environ, monkeypatch, capsys):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as raised:
        resolve_config({})  # what patch_trainer does
    message = str(raised.value)
    assert main(["env"]) == 2
    assert capsys.readouterr().err == f"leantrain env: error: {message}\n"
    with pytest.raises(SystemExit) as run_exit:
        launch.parse(["train.py"])
    assert run_exit.value.code == 2 and f"leantrain run: error: {message}\n" in capsys.readouterr().err


def test_env_lists_the_variables_set_with_their_parsed_values(monkeypatch, capsys):
    for name, value in {
        "LEANTRAIN_CGGR": "auto",
        "LEANTRAIN_OSFT": "YES",
        "LEANTRAIN_CGGR_MIN_TOKENS_RATIO": " 0.3 ",
        "LEANTRAIN_OSFT_TARGETS": "q_proj, v_proj",
        "LEANTRAIN_DISABLE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("LEANTRAIN_* variables set (5)") :].splitlines()[1:]
    assert [line.split()[0] for line in listed[:5]] == [
        "LEANTRAIN_CGGR=auto",
        "LEANTRAIN_OSFT=YES",
        "LEANTRAIN_DISABLE=1",
        "LEANTRAIN_CGGR_MIN_TOKENS_RATIO=",
        "LEANTRAIN_OSFT_TARGETS=q_proj,",
    ]
    assert listed[0].endswith("cggr = auto") and listed[1].endswith("osft = True (required)")
    assert listed[2].endswith("disable = True") and listed[3].endswith("cggr_min_tokens_ratio = 0.3")
    assert listed[4].endswith("osft_targets = ('q_proj', 'v_proj')") and "kill switch is on" in listed[5]


def test_env_with_nothing_set_says_so():
    done = subprocess.run([sys.executable, "-m", "leantrain", "env"], capture_output=True, text=True, check=True)
    assert done.stdout.rstrip().endswith("LEANTRAIN_* variables: none set (defaults apply)")


def test_env_aligns_the_readiness_column_after_the_longest_name():
    from leantrain.cli.commands import env_report

    lines = env_report().splitlines()
    start = lines.index("optimizations (readiness on this machine, before seeing a trainer):") + 1
    rows = lines[start : start + len(OPTIMIZATIONS)]
    assert [row.split()[0] for row in rows] == list(OPTIMIZATIONS)
    columns = {len(row) - len(row[2:].split(maxsplit=1)[1]) for row in rows}  # where each state starts
    assert columns == {2 + max(map(len, OPTIMIZATIONS)) + 2}, rows
