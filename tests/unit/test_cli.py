import json
import math
import re
import subprocess
import sys

import pytest

from leantrain.__main__ import main
from leantrain.config import OPTIMIZATIONS
from leantrain.demo import LOSS_RTOL, NO_VALUE, RunResult, _table, loss_agreement


def test_env_command_runs():
    out = subprocess.run([sys.executable, "-m", "leantrain", "env"], capture_output=True, text=True, check=True).stdout
    for name in ("torch", "transformers", "trl", *OPTIMIZATIONS):
        assert name in out


def _table_lines(out: str) -> list[str]:
    start = out.index("train loss (mean of last 5 logs)")
    return out[start:].split("\n\ntrain loss, stock vs leantrain")[0].splitlines()


@pytest.mark.slow
def test_demo_default_applies_moe4bit_not_cggr_and_matches_stock(tmp_path, capsys):
    """The default demo: leantrain's defaults (no options) apply the grouped 4-bit experts, leave CGGR off, and the
    stock and patched loss curves agree within the printed bound."""
    pytest.importorskip("bitsandbytes")
    main(["demo", "--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "demo.json").read_text())
    lean = summary["leantrain"]
    assert lean["applied"] == ["moe4bit"], lean["report"]
    assert re.search(r"^cggr +disabled ", lean["report"], re.M)  # the name column is as wide as the longest name
    assert len(summary["stock"]["losses"]) == len(lean["losses"]) == 3
    assert summary["loss_max_abs_diff"] <= summary["loss_bound"] > 0
    assert ": match" in out and "x faster" in out
    assert all("nan" not in line for line in _table_lines(out))
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["sft", "grpo"])
def test_demo_tables_have_no_nan(tmp_path, capsys, trainer):
    """Every trainer's table: no nan anywhere (a GRPO run has no eval loss: its cell reads NO_VALUE)."""
    main(["demo", "--smoke", "--model", "llama", "--trainer", trainer, "--out", str(tmp_path)])
    lines = _table_lines(capsys.readouterr().out)
    assert lines and all("nan" not in line.lower() for line in lines)
    eval_row = next(line for line in lines if line.startswith("eval loss"))
    assert (NO_VALUE in eval_row) == (trainer == "grpo")
    assert "cggr" not in json.loads((tmp_path / "demo.json").read_text())["leantrain"]["applied"]


@pytest.mark.slow
def test_demo_cggr_is_behind_its_flag(tmp_path, capsys):
    main(["demo", "--smoke", "--model", "llama", "--cggr", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "cggr" in json.loads((tmp_path / "demo.json").read_text())["leantrain"]["applied"]
    assert "changes which tokens train" in out


def test_table_prints_no_nan_for_missing_values():
    stock = RunResult("stock", losses=[(1, 2.0)], rewards=[(1, 0.5)], step_seconds=[1.0, 0.5], seconds=1.5)
    lean = RunResult("leantrain", losses=[(1, 2.0)], rewards=[(1, 0.6)], seconds=0.0, eval_loss=float("nan"))
    table = _table(stock, lean, "peak")
    assert "nan" not in table.lower() and NO_VALUE in table


def test_loss_agreement_bound_scales_with_the_loss():
    stock = RunResult("stock", losses=[(1, 4.0), (2, 3.0)])
    within = RunResult("leantrain", losses=[(1, 4.0), (2, 3.0 + 0.5 * LOSS_RTOL * 4.0)])
    beyond = RunResult("leantrain", losses=[(1, 4.0), (2, 3.0 + 2 * LOSS_RTOL * 4.0)])
    diff, bound = loss_agreement(stock, within)
    assert math.isclose(bound, LOSS_RTOL * 4.0) and diff <= bound
    diff, bound = loss_agreement(stock, beyond)
    assert diff > bound


def test_demo_rejects_bad_steps(tmp_path):
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0", "--out", str(tmp_path)])
