"""ARCHITECTURE.md's checklist for adding an optimization, walked for every registered one: the four that exist
prove the list complete (a new one that skips a step fails here)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from leantrain.config import OPTIMIZATIONS, LeantrainConfig
from leantrain.optimization import Optimization, registry


ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text()
FIELDS = {f.name: f for f in dataclasses.fields(LeantrainConfig)}


@pytest.mark.parametrize("name", OPTIMIZATIONS)
def test_1_name_and_toggle(name):
    field = FIELDS[name]
    assert field.metadata["kind"] == "tristate", f"{name}: the toggle must be auto/1/0"
    assert f"| `{LeantrainConfig.env_name(name)}` |" in README, f"{name}: no row in the README's env table"
    opt = registry()[name]
    if field.default is False:  # math-changing: opt-in, and the report says why
        assert opt.off_by_default_why, f"{name} is off by default without off_by_default_why"


@pytest.mark.parametrize("name", OPTIMIZATIONS)
def test_2_package_and_file_roles(name):
    package = ROOT / "src" / "leantrain" / name
    for role in ("__init__.py", "probe.py", "patch.py"):
        assert (package / role).exists(), f"{name}: no {role}"
    own_math = (package / "ops.py").exists()
    shared_math = any("..lm_head" in f.read_text() for f in package.glob("*.py"))
    assert own_math or shared_math, f"{name}: no math module (its own ops.py, or the shared leantrain.lm_head)"
    opt = registry()[name]
    assert type(opt).__module__ == f"leantrain.{name}", f"{name}: the Optimization is not in its __init__.py"
    assert isinstance(opt, Optimization) and opt.name == name and opt.trainer_kinds


@pytest.mark.parametrize("name", OPTIMIZATIONS)
def test_3_4_probe_returns_the_plan_apply_takes_it(name):
    cls = type(registry()[name])
    assert list(inspect.signature(cls.probe).parameters) == ["self", "trainer", "ctx"]
    assert list(inspect.signature(cls.apply).parameters)[:4] == ["self", "trainer", "plan", "ctx"]
    source = inspect.getsource(inspect.getmodule(cls))
    assert "Undo()" not in source, f"{name}: records on ctx.undo only"


@pytest.mark.parametrize("name", OPTIMIZATIONS)
def test_5_saved_weights_declared(name):
    assert registry()[name].saved_weights.strip(), f"{name}: say what save_model() writes"


@pytest.mark.parametrize("name", OPTIMIZATIONS)
def test_6_tests_on_cpu_and_cuda(name):
    assert list((ROOT / "tests" / "parity").glob(f"test_{name}*.py")), f"{name}: no CPU parity tests"
    assert list((ROOT / "tests" / "gpu").glob(f"test_{name}*_cuda.py")), f"{name}: no CUDA tests"


@pytest.mark.parametrize("name", OPTIMIZATIONS)
def test_7_8_benchmark_and_docs(name):
    assert (ROOT / "benchmarks" / f"bench_{name}.py").exists(), f"{name}: no benchmark"
    assert f"| `{name}` |" in README, f"{name}: no row in the README's optimizations table"
    assert f"| `{name}` |" in ARCHITECTURE, f"{name}: no row in ARCHITECTURE.md's file-role table"
