import json
import subprocess
import sys

import pytest

from leantrain.config import OPTIMIZATIONS


def test_env_command_runs():
    out = subprocess.run([sys.executable, "-m", "leantrain", "env"], capture_output=True, text=True, check=True).stdout
    for name in ("torch", "transformers", "trl", *OPTIMIZATIONS):
        assert name in out


# The help a user reads first: instant, so it loads neither torch nor transformers (the entry point and the
# optimizations load when a command runs a trainer).
HELP = [["--help"], [], ["run", "--help"], ["compare", "--help"]]
PROBE = """
import json, runpy, sys
sys.argv = ["leantrain", *json.loads(sys.argv[1])]
try:
    runpy.run_module("leantrain", run_name="__main__", alter_sys=True)
except SystemExit as done:
    code = done.code
else:
    code = 0
print(json.dumps({"code": code, "heavy": [m for m in ("torch", "transformers") if m in sys.modules]}), file=sys.stderr)
"""


def _help(argv: list[str]) -> tuple[str, dict]:
    """``python -m leantrain ARGV`` in a fresh interpreter: its stdout, exit code and the heavy modules it loaded."""
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=120)
    return done.stdout, json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", HELP, ids=lambda a: " ".join(a) or "bare")
def test_help_loads_neither_torch_nor_transformers(argv):
    out, seen = _help(argv)
    assert out.startswith("usage: leantrain") and seen["code"] in (0, None), (out, seen)
    assert seen["heavy"] == [], seen


def test_demo_help_loads_neither_torch_nor_transformers():
    out, seen = _help(["demo", "--help"])
    assert out.startswith("usage: leantrain demo") and seen["heavy"] == [], seen


def test_the_package_loads_its_entry_point_on_first_use():
    probe = (
        "import sys, leantrain; before = 'torch' in sys.modules; from leantrain import patch_trainer; "
        "print(before, 'torch' in sys.modules, patch_trainer.__module__, 'patch_trainer' in dir(leantrain))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["False", "True", "leantrain.entry", "True"]
    import leantrain

    with pytest.raises(AttributeError, match="no attribute 'patch_trainr'"):
        leantrain.patch_trainr  # noqa: B018
