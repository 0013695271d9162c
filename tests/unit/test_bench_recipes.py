"""benchmarks/bench_recipes.py (and its recipes/ package): the --smoke run (every recipe, tiny shapes, CPU) writes
sane rows, table and plot; the step clock's split is exclusive; merging runs keeps the other recipes' rows."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Row  # noqa: E402
from recipes import moe_qlora, report, runner  # noqa: E402


# -- pure pieces (fast) --------------------------------------------------------------------------------------------


class _Fake:
    """Nested methods like a trainer's: training_step -> _prepare_inputs -> _generate, then compute_loss."""

    def _generate(self) -> None:
        time.sleep(0.02)

    def _prepare_inputs(self) -> None:
        time.sleep(0.01)
        self._generate()

    def compute_loss(self) -> None:
        time.sleep(0.01)

    def training_step(self) -> None:
        self._prepare_inputs()
        self.compute_loss()
        time.sleep(0.01)


def test_step_clock_split_is_exclusive():
    fake, clock = _Fake(), runner.StepClock(cuda=False, label="fake")
    for attr, part in (("training_step", "backward"), ("_prepare_inputs", "prepare"), ("compute_loss", "forward"),
                       ("_generate", "generation")):  # fmt: skip
        clock.wrap(fake, attr, part)
    clock.begin = clock.now()
    fake.training_step()
    clock.step_end(1)
    step = clock.steps[0]
    parts = step["parts"]
    # each part is its own sleep (plus call overhead), not its callees': generation is not counted again in prepare
    for part, slept in (("generation", 0.02), ("prepare", 0.01), ("forward", 0.01), ("backward", 0.01)):
        assert slept * 1e3 <= parts[part] < slept * 1e3 + 15, (part, parts)
    assert parts["other"] >= 0 and sum(parts.values()) == pytest.approx(step["total_ms"])


def test_merge_replaces_only_the_recipe_configs_run():
    def row(recipe: str, config: str, provider: str) -> Row:
        return Row("recipes", provider, recipe, "speed", "ms/step", "config", config, 1.0)

    old = [row("grpo", "0.5b beta=0", "stock"), row("grpo", "1.5b beta=0", "stock"), row("sft", "0.5b", "stock")]
    new = [row("grpo", "1.5b beta=0", "leantrain")]
    merged = report.merge(old, new)
    assert [(r.mode, r.x_value, r.provider) for r in merged] == [
        ("grpo", "0.5b beta=0", "stock"),
        ("sft", "0.5b", "stock"),
        ("grpo", "1.5b beta=0", "leantrain"),
    ]


def _steps(rows: list[tuple[bool, float, float]]) -> dict:
    return {"steps": [{"step": i + 1, "warmup": w, "total_ms": tot, "parts": {"generation": gen}}
                      for i, (w, tot, gen) in enumerate(rows)]}  # fmt: skip


def test_time_outside_generation_and_warmup_spikes():
    # warm-up steps ignored; timed rests 250, 2600 (a new sequence length), 260, 240 -> median 255
    config = _steps([(True, 9000, 1000), (False, 8250, 8000), (False, 10600, 8000), (False, 9260, 9000),
                     (False, 7240, 7000)])  # fmt: skip
    assert report.without_generation(config) == pytest.approx(255.0)
    spikes = report.warmup_spikes(config)
    assert len(spikes) == 1 and spikes[0].startswith("step 3 took 2600 ms outside generation (10.2x")
    assert report.warmup_spikes(_steps([(False, 300, 0), (False, 320, 0), (False, 310, 0)])) == []
    assert report.without_generation(_steps([(False, 300, 0), (False, 320, 0)])) is None  # no generation


# -- the smoke run (one subprocess for all tests below) ------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, list[dict]]:
    for name in ("trl", "peft", "bitsandbytes", "matplotlib", "datasets"):
        pytest.importorskip(name)
    out = tmp_path_factory.mktemp("recipes")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEANTRAIN_", "BENCH_RECIPE"))}
    env.update(BENCH_RESULTS=str(out), PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    script = ROOT / "benchmarks" / "bench_recipes.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke"], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, json.loads((out / "recipes.json").read_text())


def speed_rows(rows: list[dict], recipe: str | None = None) -> list[dict]:
    return [r for r in rows if r["metric"] == "speed" and recipe in (None, r["mode"])]


def variant(rows: list[dict], recipe: str, config: str, name: str) -> dict:
    (found,) = [r for r in speed_rows(rows, recipe) if r["x_value"] == config and r["provider"] == name]
    return found["config"]


@pytest.mark.slow
def test_every_recipe_ran_stock_and_leantrain(smoke):
    _, rows = smoke
    problems = [(r["mode"], r["provider"], r["metric"], r["unit"]) for r in rows if r["metric"] in ("failed", "oom")]
    assert not problems
    skipped = [r for r in rows if r["metric"] == "skipped"]
    assert all(r["config"]["kind"] == "peer" for r in skipped), skipped  # only mini_trainer may be unavailable
    for recipe in runner.RECIPES:
        kinds = {r["config"]["kind"] for r in speed_rows(rows, recipe)}
        assert {"stock", "leantrain"} <= kinds, (recipe, kinds)


@pytest.mark.slow
def test_split_parts_sum_to_the_step_and_losses_are_finite(smoke):
    _, rows = smoke
    for r in speed_rows(rows):
        c = r["config"]
        assert len(c["steps"]) >= 2 and c["steps"][0]["warmup"] and not c["steps"][-1]["warmup"]
        for step in c["steps"]:
            parts = step["parts"]
            assert set(parts) == set(runner.PARTS)
            assert all(v >= 0 for k, v in parts.items() if k != "other"), parts
            # "other" is the step minus the timed parts: it is >= 0 exactly when the parts fit inside the step
            assert parts["other"] >= 0 and sum(parts.values()) == pytest.approx(step["total_ms"]), parts
            assert step["tokens"] > 0
        timed = [s["total_ms"] for s in c["steps"] if not s["warmup"]]
        assert r["p50"] == pytest.approx(statistics.median(timed))
        assert c["tokens_per_s"] > 0
        assert all(math.isfinite(loss) for loss in c["losses"]), (r["mode"], r["provider"], c["losses"])


@pytest.mark.slow
def test_leantrain_applied_and_matches_stock_where_the_math_is_the_same(smoke):
    _, rows = smoke
    for r in speed_rows(rows):
        c = r["config"]
        report = c["report"]
        if c["kind"] != "leantrain":
            assert report is None  # stock, reference and peer runs are never patched
            continue
        applied = {o["name"] for o in report["outcomes"] if o["status"] == "applied"}
        assert (
            applied == {"grpo": {"grpo_logps"}, "sft": {"cggr"}, "moe_qlora": {"moe4bit"}, "osft": {"osft"}}[r["mode"]]
        )
    # Grouped 4-bit experts are bit-identical to the same layout's stock path in fp32
    # (tests/parity/test_moe4bit_model.py), so the whole run's losses are too.
    config = speed_rows(rows, "moe_qlora")[0]["x_value"]
    pairs = [(name, baseline) for name, _, baseline, _, _ in moe_qlora.MOE_VARIANTS if baseline]
    assert len(pairs) == 2
    for mine, stock in pairs:
        assert (
            variant(rows, "moe_qlora", config, mine)["losses"] == variant(rows, "moe_qlora", config, stock)["losses"]
        )
    # OSFT: the same factors and the same projection math in fp32; different op order -> a few fp32 ulps of a
    # loss ~7.6 (eps 1.2e-7): 2e-5 relative is ~100 ulps.
    config = speed_rows(rows, "osft")[0]["x_value"]
    ours = variant(rows, "osft", config, "leantrain osft")["losses"]
    peer = [r for r in speed_rows(rows, "osft") if r["provider"].startswith("mini_trainer")]
    for row in peer:
        assert row["config"]["losses"] == pytest.approx(ours, rel=2e-5)


@pytest.mark.slow
def test_grpo_same_completions_and_near_equal_loss(smoke):
    _, rows = smoke
    configs = {r["x_value"] for r in speed_rows(rows, "grpo")}
    assert len(configs) == 2  # beta 0.04 (reference model) and beta 0
    for config in configs:
        stock, mine = variant(rows, "grpo", config, "stock"), variant(rows, "grpo", config, "leantrain")
        first_stock, first_mine = stock["steps"][0], mine["steps"][0]
        # Step 1: the same weights and seed, and leantrain leaves generation alone -> the very same completions.
        assert first_mine["completion_hash"] == first_stock["completion_hash"]
        assert first_mine["completion_lengths"] == first_stock["completion_lengths"]
        # GRPO's loss is ~0 (group-normalised advantages x importance ratio 1); fused vs chunked log-probs differ by
        # ~1e-6 in fp32, which moves the loss by ~1e-6 x mean |advantage| (~1): 1e-5 absolute.
        assert mine["losses"] == pytest.approx(stock["losses"], abs=1e-5)


@pytest.mark.slow
def test_cggr_really_masked_labels_at_its_ratio(smoke):
    _, rows = smoke
    cggr = [r for r in speed_rows(rows, "sft") if r["config"]["kind"] == "leantrain"]
    assert {r["config"]["settings"]["cggr_ratio"] for r in cggr} == {0.25, 0.5}
    for r in cggr:
        c = r["config"]
        ratio, seq = c["settings"]["cggr_ratio"], c["settings"]["seq"]
        kept = c["metrics"]["cggr/kept_fraction"]
        # every step (warm-up 0) keeps ceil(ratio x targets) of each row's seq - 1 targets
        assert len(kept) == len(c["steps"])
        assert all(ratio <= k <= ratio + 1 / (seq - 1) for k in kept), (ratio, kept)
    stock = variant(rows, "sft", cggr[0]["x_value"], "stock")
    assert "cggr/kept_fraction" not in stock["metrics"]


@pytest.mark.slow
def test_table_and_plot_written(smoke):
    out, rows = smoke
    md = (out / "recipes.md").read_text()
    assert "| recipe | config | variant | step ms (p50) |" in md
    for recipe in runner.RECIPES:
        assert f"| {recipe} |" in md
    assert "Differences" in md
    png = (out / "recipes.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    assert all(r["device"].startswith("cpu") for r in rows)
