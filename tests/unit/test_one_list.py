"""One list of optimization names, the option table's (``config.OPTIMIZATIONS``): the tests' isolating helper, the
CI compatibility table and the recipes all read it, so a new optimization needs no edit in any of them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from leantrain.config import OPTIMIZATIONS
from leantrain.optimization import registry
from testkit.optimizations import only, others_off


ROOT = Path(__file__).resolve().parents[2]


def _compat_table():
    spec = importlib.util.spec_from_file_location("compat_table", ROOT / ".ci" / "compat_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", OPTIMIZATIONS)
def test_only_turns_on_one_and_every_other_off(name):
    assert only(name) == {other: other == name for other in OPTIMIZATIONS}
    assert only(name, None)[name] is None and others_off(name) == {o: False for o in OPTIMIZATIONS if o != name}
    with pytest.raises(ValueError, match="not an optimization"):
        others_off("no_such_optimization")


def test_compat_table_tries_every_optimization_on_every_kind_it_declares():
    table = _compat_table()
    assert table.OPTIMIZATIONS == OPTIMIZATIONS
    rows = table.scenarios()
    assert [name for name in OPTIMIZATIONS if any(r[0] == name for r in rows)] == list(OPTIMIZATIONS)
    for name, opt in registry().items():
        if name not in table.MODEL_SCENARIOS:
            labels = [label for o, label, _ in rows if o == name]
            expected = [label for kind in opt.trainer_kinds for label, _ in table.KIND_SCENARIOS[kind]]
            assert sorted(labels) == sorted(expected), name


def test_compat_table_renders_a_section_per_optimization_without_importing_leantrain(tmp_path):
    """`render` runs under a bare python3 in CI (no torch): -S leaves site-packages out of reach."""
    rows = [{"optimization": name, "scenario": "Trainer", "status": "applied", "why": "x"} for name in OPTIMIZATIONS]
    versions = dict.fromkeys(_compat_table().PACKAGES, "1.0")
    record = tmp_path / "set.json"
    record.write_text(json.dumps({"set": "latest", "label": "", "rows": rows, "versions": versions}))
    done = subprocess.run(
        [sys.executable, "-S", str(ROOT / ".ci" / "compat_table.py"), "render", str(record)],
        capture_output=True,
        text=True,
        check=True,
    )
    sections = [line[4:-1] for line in done.stdout.splitlines() if line.startswith("## `")]
    assert sections == list(OPTIMIZATIONS)


def test_recipes_turn_every_optimization_off_but_the_one_they_time():
    from recipes.runner import ONLY

    assert ONLY == dict.fromkeys(OPTIMIZATIONS, False)
