import subprocess
import sys


def test_env_command_runs():
    out = subprocess.run([sys.executable, "-m", "leantrain", "env"], capture_output=True, text=True, check=True).stdout
    for name in ("torch", "transformers", "trl", "moe4bit", "osft", "cggr", "grpo_logps"):
        assert name in out
