import subprocess
import sys

from leantrain.config import OPTIMIZATIONS


def test_env_command_runs():
    out = subprocess.run([sys.executable, "-m", "leantrain", "env"], capture_output=True, text=True, check=True).stdout
    for name in ("torch", "transformers", "trl", *OPTIMIZATIONS):
        assert name in out
