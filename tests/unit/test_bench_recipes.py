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


def _record(name: str, order_ms: float, wall_s: float = 3.0) -> dict:
    steps = [{"step": 1, "warmup": True, "total_ms": 99.0, "parts": {}, "tokens": 1},
             {"step": 2, "warmup": False, "total_ms": order_ms, "parts": {}, "tokens": 1}]  # fmt: skip
    return dict(variant=name, status="ok", reason="", steps=steps, losses=[1.0, 0.5], final_loss=0.5,
                metrics={"kl": [0.0, 0.1]}, peak_gib=2.0, base_gib=0.0, build_s=1.0, train_s=2.0,
                wall_s=wall_s)  # fmt: skip


def test_both_orders_prime_then_swap_and_merge(monkeypatch):
    ran: list[tuple[str, bool]] = []
    times = iter([10.0, 20.0, 30.0, 40.0, 11.0, 21.0])  # priming A, B; first order A, B; second order B, A

    def fake_run(v, steps, s):
        ran.append((v.name, v.skip is None))
        return _record(v.name, next(times)) if v.skip is None else dict(_record(v.name, 0.0), status="skipped")

    monkeypatch.setattr(runner, "run_variant", fake_run)
    pair = [runner.Variant("grpo", "c", n, n, None, lambda: None) for n in ("stock", "leantrain")]
    merged = runner.run_both_orders(pair, (1, 1), None, runner.Budget(1e9), prime=True)
    assert [n for n, _ in ran] == ["stock", "leantrain", "stock", "leantrain", "leantrain", "stock"]
    assert [m["variant"] for m in merged] == ["stock", "leantrain"]
    stock = merged[0]
    assert [st["order"] for st in stock["steps"]] == [0, 0, 1, 1]
    assert [st["total_ms"] for st in stock["steps"] if not st["warmup"]] == [30.0, 21.0]
    assert stock["losses"] == [1.0, 0.5, 1.0, 0.5] and stock["metrics"]["kl"] == [0.0, 0.1, 0.0, 0.1]
    assert stock["wall_s"] == 6.0 and stock["peak_gib"] == 2.0
    assert stock["timing"] == "primed, both orders, medians over both (stock first, then leantrain first)"
    assert report.per_order(stock) == ["step p50 per order 30.0 / 21.0 ms (first order, then the other)"]


def test_second_order_skipped_by_the_budget_says_one_order(monkeypatch):
    def fake_run(v, steps, s):
        skipped = dict(runner.base_record(v), status="skipped", reason=v.skip)
        return _record(v.name, 10.0, wall_s=60.0) if v.skip is None else skipped

    monkeypatch.setattr(runner, "run_variant", fake_run)
    pair = [runner.Variant("grpo", "c", n, n, None, lambda: None) for n in ("stock", "leantrain")]
    # 100 s: the first order fits (nothing measured yet), then 2 more runs of 60 s would not
    merged = runner.run_both_orders(pair, (1, 1), None, runner.Budget(100.0), prime=False)
    assert [m["variant"] for m in merged] == ["stock", "leantrain"]
    assert all("order" not in st for m in merged for st in m["steps"])
    assert all(
        m["timing"].startswith("one order (stock, then leantrain, the other skipped: recipe time") for m in merged
    )


def test_memory_projection_from_two_layer_counts():
    def row(layers: int, peak: float, provider: str = "stock") -> Row:
        config = {"peak_gib": peak, "settings": {"layers": layers, "full_layers": 48}}
        return Row("recipes", provider, "moe_qlora_experts", "speed", "ms/step", "config", f"{layers}L", 1.0,
                   config=config)  # fmt: skip

    rows = [row(2, 6.0), row(4, 7.0), row(2, 9.0, "other"), row(4, 13.0, "other")]
    cells = {(r.provider, r.x_value): cell for r, cell in report.memory_projection(rows)}
    # stock: 0.5 GiB a layer, 7 + 44 x 0.5 = 29 GiB; other: 2 GiB a layer, 13 + 88 = 101 GiB; only the larger count
    assert cells == {
        ("stock", "4L"): "0.50 -> 29.0 at 48 layers (does not fit 24 GiB)",
        ("other", "4L"): "2.00 -> 101.0 at 48 layers (does not fit 24 GiB)",
    }
    assert report.memory_projection([row(2, 1.0), row(4, 1.5)])[0][1].endswith("(fits 24 GiB)")  # 1.5 + 11
    assert report.memory_projection([row(4, 7.0)]) == []  # one count: no slope


def test_no_benchmark_file_over_800_lines():
    long = {p.name: n for p in (ROOT / "benchmarks").rglob("*.py") if (n := len(p.read_text().splitlines())) > 800}
    assert not long, long


# -- the smoke run (one subprocess for all tests below) ------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, list[dict]]:
    for name in ("trl", "peft", "bitsandbytes", "matplotlib", "datasets"):
        pytest.importorskip(name)
    out = tmp_path_factory.mktemp("recipes")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LEANTRAIN_", "BENCH_RECIPE"))}
    env.update(
        BENCH_RESULTS=str(out), PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    )
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
    # Only the 4-bit expert variants may be "not measured", and only because PEFT made no expert adapters on the
    # quantized stacks (until PEFT target_parameters serves them): recorded, never timed as attention-only LoRA.
    unmeasured = [r for r in rows if r["metric"] == "not measured"]
    for r in unmeasured:
        assert r["mode"] == "moe_qlora_experts" and "4-bit experts" in r["provider"], r["provider"]
        assert r["unit"].startswith("no expert adapters were created"), r["unit"]
    for recipe in runner.RECIPES:
        kinds = {r["config"]["kind"] for r in speed_rows(rows, recipe)}
        kinds |= {r["config"]["kind"] for r in unmeasured if r["mode"] == recipe}
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
        if r["mode"] == "dense_sft":  # the defaults' report is recorded, not assumed (test_dense_sft_rows)
            continue
        applied = {o["name"] for o in report["outcomes"] if o["status"] == "applied"}
        expected = dict(grpo={"grpo_logps"}, grpo_lora={"grpo_logps"}, sft={"cggr"}, moe_qlora={"moe4bit"})
        expected.update(osft={"osft"}, moe_qlora_experts={"moe4bit"})
        if r["mode"] == "moe_qlora_experts" and not applied:  # moe4bit may decline LoRA experts: it says why
            (moe4bit,) = [o for o in report["outcomes"] if o["name"] == "moe4bit"]
            assert moe4bit["reason"], moe4bit
            continue
        assert applied == expected[r["mode"]], (r["mode"], applied)
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
def test_grpo_pairs_timed_in_both_orders(smoke):
    _, rows = smoke
    for r in speed_rows(rows, "grpo_lora"):  # the 7B: primed, one order (both would not fit 8 minutes)
        assert r["config"]["timing"] == "primed, one order (stock, then leantrain)", r["config"]["timing"]
    for r in speed_rows(rows, "grpo"):
        c = r["config"]
        assert "both orders" in c["timing"], c["timing"]
        orders = [st["order"] for st in c["steps"]]
        assert orders == sorted(orders) and orders.count(0) == orders.count(1) > 0, orders
    primed = {r["x_value"]: r["config"]["timing"].startswith("primed") for r in speed_rows(rows, "grpo")}
    assert sorted(primed.values()) == [False, True]  # the first beta primes the shape, the second reuses it
    _, table_text = smoke[0], (smoke[0] / "recipes.md").read_text()
    assert "| timed |" in table_text and "medians over both" in table_text


@pytest.mark.slow
def test_grpo_same_completions_and_near_equal_loss(smoke):
    _, rows = smoke
    configs = [("grpo", x) for x in {r["x_value"] for r in speed_rows(rows, "grpo")}]
    assert len(configs) == 2  # beta 0.04 (reference model) and beta 0
    configs += [("grpo_lora", x) for x in {r["x_value"] for r in speed_rows(rows, "grpo_lora")}]
    assert len(configs) == 3  # LoRA at beta 0.04: the reference is the base model, adapters disabled
    for recipe, config in configs:
        stock, mine = variant(rows, recipe, config, "stock"), variant(rows, recipe, config, "leantrain")
        # The first step of each order: the same weights and seed, and leantrain leaves generation alone -> the very
        # same completions (and the second order's first step repeats the first order's).
        orders = sorted({st.get("order", 0) for st in stock["steps"]})
        firsts = [[st for st in run["steps"] if st.get("order", 0) == k][0] for run in (stock, mine) for k in orders]
        assert len({st["completion_hash"] for st in firsts}) == 1
        assert all(st["completion_lengths"] == firsts[0]["completion_lengths"] for st in firsts)
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


@pytest.mark.slow
def test_moe_qlora_experts_rows(smoke):
    _, rows = smoke
    mine = [r for r in rows if r["mode"] == "moe_qlora_experts" and r["metric"] in ("speed", "not measured")]
    assert {r["config"]["settings"]["layers"] for r in mine} == {1, 2}  # two counts: the per-layer memory
    for r in mine:
        assert r["config"]["settings"]["full_layers"] == 2
    stock = [r for r in mine if r["provider"] == "stock (bf16 experts)"]
    assert len(stock) == 2 and all(r["metric"] == "speed" for r in stock)
    for r in stock:  # LoRA A and B on gate_up_proj and down_proj of every layer
        extra = r["config"]["extra"]
        assert extra["expert_lora_params"] == 4 * r["config"]["settings"]["layers"], extra
    for r in mine:
        if r["metric"] == "speed":
            assert r["config"]["extra"]["expert_lora_params"] > 0


@pytest.mark.slow
def test_dense_sft_rows(smoke):
    """SFTTrainer's default path and the plain Trainer's full logits; every variant on the first, the compile
    provider on the SFT path only, Liger as a peer (skipped on the CPU); the same training in fp32 (the layer
    kernels' stand-ins are the stock arithmetic there); the first step's time on every row."""
    out, rows = smoke
    mine = [r for r in rows if r["mode"] == "dense_sft" and r["metric"] in ("speed", "skipped")]
    configs = {r["x_value"] for r in mine}
    assert configs == {"tiny-gemma2 sft 2x64", "tiny-gemma2 trainer logits 2x64"}  # TRL >= 1.15: no nll logits
    for config in configs:
        names = {r["provider"] for r in mine if r["x_value"] == config}
        expected = {"stock", "leantrain", "leantrain layer_kernels", "liger (use_liger_kernel)"}
        assert names == expected | ({"regional compile"} if " sft " in config else set()), names
        stock = variant(rows, "dense_sft", config, "stock")
        for r in mine:
            c = r["config"]
            if r["x_value"] != config or r["metric"] == "skipped":
                assert r["metric"] != "skipped" or ("liger" in r["provider"] and c["kind"] == "peer")
                continue
            assert c["losses"] == pytest.approx(stock["losses"], rel=1e-5), r["provider"]
            assert c["first_step_ms"] == c["steps"][0]["total_ms"] > 0
            assert c["settings"]["lora_targets"] == "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
            assert c["settings"]["trainer"] == ("Trainer" if "logits" in config else "SFTTrainer")
            if r["provider"].startswith("leantrain"):  # the report is recorded, whatever the defaults are
                from leantrain.layer_kernels import MEASURED

                status = {o["name"]: o["status"] for o in c["report"]["outcomes"]}["layer_kernels"]
                asked = r["provider"] == "leantrain layer_kernels" or MEASURED["gemma2"].faster
                assert status == ("applied" if asked else "skipped"), (r["provider"], status)
            if r["provider"] == "regional compile":
                assert c["settings"]["compile"] == "layer.compile() per decoder layer, eager"
    assert "| first step ms |" in (out / "recipes.md").read_text()
