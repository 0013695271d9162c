import json
import subprocess
import sys

import pytest

from leantrain.__main__ import main


def test_env_command_runs():
    out = subprocess.run([sys.executable, "-m", "leantrain", "env"], capture_output=True, text=True, check=True).stdout
    for name in ("torch", "transformers", "trl", "moe4bit", "osft", "cggr", "grpo_logps"):
        assert name in out


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["sft", "grpo"])
def test_demo_end_to_end(tmp_path, capsys, trainer):
    main(["demo", "--steps", "3", "--trainer", trainer, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "leantrain patch report" in out and "tokens/s" in out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert len(summary["stock"]["losses"]) == 3 and len(summary["leantrain"]["losses"]) == 3
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000


def test_demo_rejects_bad_steps(tmp_path):
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0", "--out", str(tmp_path)])
