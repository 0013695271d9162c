import os
from pathlib import Path

import pytest
import torch


# Long CPU tests, whole files at a time: the 2-process distributed runs, the benchmark recipes' runs and
# `leantrain run` end to end (its targets in subprocesses). Marked `slow` here, in one place: the README's test
# command deselects them (-m "not slow", minutes on 2 cores), CI runs them after it (-m slow). Single tests elsewhere
# carry the marker themselves.
TESTS = Path(__file__).resolve().parent
SLOW_DIRS = ("distributed",)
SLOW_FILES = frozenset({"unit/test_bench_moe4bit_full.py", "unit/test_bench_recipes.py", "unit/test_run.py"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(TESTS)
        if rel.parts[0] in SLOW_DIRS or rel.as_posix() in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


# Leantrain reads LEANTRAIN_* at patch time; a developer's shell must not leak into the tests.
for _name in [n for n in os.environ if n.startswith("LEANTRAIN_")]:
    del os.environ[_name]

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _restore_environ():
    """Each test sees the environment it started with: transformers 4.57's TrainingArguments(bf16=True) exports
    ACCELERATE_MIXED_PRECISION=bf16, which every later Accelerator in the process reads, so one bf16 test would
    put autocast on the forward of the next fp32 test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _fallback_fails_the_test(request, monkeypatch):
    """A run-time fallback (``RuntimeFallback``: the first unexpected error of an optimized path warns and serves the
    stock path) is a defect report, not a quiet success: the test fails unless it expects one
    (``@pytest.mark.expect_fallback``). Subprocesses (the distributed workers, the Triton interpreter scripts) are
    outside this net."""
    from leantrain.fallback import RuntimeFallback

    seen: list[str] = []
    original = RuntimeFallback.fail

    def fail(self, reason: str) -> None:
        if self.failed is None:
            seen.append(f"{self.name}: {reason}")
        original(self, reason)

    monkeypatch.setattr(RuntimeFallback, "fail", fail)
    yield
    if seen and request.node.get_closest_marker("expect_fallback") is None:
        pytest.fail(
            "leantrain fell back to the stock path at run time (" + "; ".join(seen) + "); mark the test "
            "@pytest.mark.expect_fallback if it triggers that on purpose",
            pytrace=False,
        )


@pytest.fixture
def fresh_dynamo():
    """A clean Dynamo state for a test (its automatic-dynamic profile would otherwise carry widths across tests):
    ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")`` in a module that compiles."""
    import torch

    with torch._dynamo.config.patch(automatic_dynamic_local_pgo=False):
        torch._dynamo.reset()
        yield
    torch._dynamo.reset()


@pytest.fixture
def own_inductor_cache(tmp_path, monkeypatch):
    """Inductor's caches in a directory of the test's own (child processes inherit it): a cache hit there can only
    be an entry the test made."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
