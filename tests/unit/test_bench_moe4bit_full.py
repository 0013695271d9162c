"""benchmarks/bench_moe4bit_full.py: the run plan, the memory arithmetic and the rules (fast), and the driver's --smoke
on CPU (slow: the GPU run must not die on a typo)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the whole-model benchmark builds transformers 5 models (3-D experts)", allow_module_level=True)
for name in ("bitsandbytes", "peft", "trl", "datasets", "matplotlib"):
    pytest.importorskip(name)

import bench_moe4bit_full as full  # noqa: E402


GIB = 2**30


def meta_model(shape: str) -> torch.nn.Module:
    cls, fields, _ = full.SHAPES[shape]
    config = getattr(transformers, cls)(**fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


# -- plan and arithmetic -------------------------------------------------------------------------------------------


def test_plan_has_every_asked_run():
    for shape in full.SHAPES:
        runs = full.plan(shape)
        ours = {(r.placement, r.optim, r.seq) for r in runs if r.provider == "leantrain" and r.grad_accum == 1}
        for placement in ("attention", "attention+experts"):
            assert {(placement, "adamw_torch", 2048), (placement, "adamw_8bit", 2048)} <= ours
            assert (placement, "adamw_8bit", 4096) in ours
        assert all(r.fit_rank for r in runs if r.provider == "leantrain" and r.placement == "attention+experts")
        assert {r.cap_gib for r in runs if r.provider == "stock"} == {24.0, None}  # recorded over the cap; uncapped
        assert len({r.key for r in runs}) == len(runs)
        assert all(r.seq <= 64 for r in full.plan(shape, smoke=True))
    (unsloth,) = [r for r in full.plan("gpt-oss-20b") if r.name == "Unsloth notebook config"]
    assert (unsloth.rank, unsloth.alpha, unsloth.optim, unsloth.seq, unsloth.grad_accum) == (
        8,
        16,
        "adamw_8bit",
        1024,
        4,
    )
    assert unsloth.targets == full.ATTENTION and full.UNSLOTH["listed"][4:] == ("gate_proj", "up_proj", "down_proj")
    assert not [r for r in full.plan("qwen3-30b-a3b") if "Unsloth" in r.name]


def test_unsloth_targets_train_what_its_notebook_logged():
    """r8 on Unsloth's target list is its logged 3,981,312 trainable values: gpt-oss has no gate/up/down_proj
    modules, so the list trains q/k/v/o of the 24 layers (what the run names)."""
    (run,) = [r for r in full.plan("gpt-oss-20b") if r.name == "Unsloth notebook config"]
    model = meta_model("gpt-oss-20b")
    listed = full.dataclasses.replace(run, targets=full.UNSLOTH["listed"])
    assert full.per_rank_values(model, listed) == full.per_rank_values(model, run)
    assert run.rank * full.per_rank_values(model, run) == full.UNSLOTH["trainable"] == 3_981_312


def test_expert_lora_arithmetic_at_qwen3_30b_a3b():
    """r16 on q/k/v/o and both stacks of all 128 experts of 48 layers: 629,145,600 expert values (the issue's ~630M)
    and 13,369,344 attention values; fp32 AdamW (16 B/value) ~9.6 GiB; bf16 adapters + 8-bit AdamW ~2.4 GiB."""
    (run,) = [r for r in full.plan("qwen3-30b-a3b") if r.name == "attn+experts r<=16 adamw_8bit" and r.seq == 2048]
    per_rank = full.per_rank_values(meta_model("qwen3-30b-a3b"), run)
    attention = 48 * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048))
    experts = 48 * 128 * ((2048 + 2 * 768) + (768 + 2048))
    assert per_rank == attention + experts and 16 * experts == 629_145_600 and 16 * attention == 13_369_344
    costs = full.arithmetic(16 * per_rank, 2, "adamw_8bit")
    assert costs["fp32_adamw_gib"] == pytest.approx(16 * per_rank * 16 / GIB)
    assert 9.5 < costs["fp32_adamw_gib"] < 9.7
    assert costs["adapters_gib"] + costs["optimizer_state_gib"] == pytest.approx(16 * per_rank * 4.03125 / GIB)


def test_state_bytes_and_choose_rank():
    assert full.state_bytes("adamw_torch", 2) == 4 and full.state_bytes("adamw_torch", 4) == 8
    assert full.state_bytes("adamw_8bit", 2) == pytest.approx(2 + 8 / 256)
    per_rank, per_value = 1_000_000, 8.0
    weights, reserve = 10 * GIB, 1.5 * GIB
    cap = weights + reserve + 7 * per_rank * per_value  # room for exactly rank 7
    assert full.choose_rank(16, per_rank, weights, cap, per_value, reserve) == 7
    assert full.choose_rank(4, per_rank, weights, cap, per_value, reserve) == 4
    assert full.choose_rank(16, per_rank, weights, weights, per_value, reserve) == 0


def test_fits_a_smaller_card_only_when_the_run_proves_it():
    ok = dict(status="ok", cap_gib=24.0, max_reserved_gib=15.2, max_allocated_gib=14.1)
    assert full.fits(24, ok) == "yes (ran under it)"
    assert full.fits(16, ok).startswith("yes (reserved <= 15.2")  # the 16 GiB cap would never have acted
    assert full.fits(15, ok).startswith("unknown")  # allocated 14.1 <= 15 < reserved 15.2: a re-run decides
    assert full.fits(14, ok).startswith("no (needs 14.1")
    assert full.fits(16, dict(ok, status="oom")) == "-"
    assert full.fits(16, dict(ok, max_reserved_gib=math.nan)).startswith("n/a")
    rerun_oom = dict(status="oom", cap_gib=15.0)
    assert full.verdict([ok, rerun_oom], 15.0) == "no (oom under it)"
    assert full.verdict([ok, dict(ok, cap_gib=15.0)], 15.0) == "yes (ran under it)"
    assert full.verdict([], 20.0) == "not measured"


def test_stock_under_a_cap_is_recorded_from_its_bf16_experts():
    stock = [r for r in full.plan("qwen3-30b-a3b") if r.provider == "stock" and r.cap_gib == 24.0][0]
    reason = full.stock_over_cap(stock, smoke=False)
    assert reason.startswith("bf16 expert stacks alone 54.0 GiB (28.99B values")  # 48 x 128 x 3 x 768 x 2048 x 2 B
    gpt_oss = [r for r in full.plan("gpt-oss-20b") if r.provider == "stock" and r.cap_gib == 24.0][0]
    assert full.stock_over_cap(gpt_oss, smoke=False).startswith("bf16 expert stacks alone 35.6 GiB")
    assert full.stock_over_cap(gpt_oss, smoke=True) is None  # the tiny shape fits: the smoke runs it
    assert full.stock_over_cap(full.plan("gpt-oss-20b")[0], smoke=False) is None  # leantrain runs are run


def test_merge_replaces_the_same_run_only():
    def row(name: str, cap, p50: float) -> full.Row:
        config = dict(shape="gpt-oss-20b", name=name, seq=2048, cap_gib=cap)
        return full.Row(full.NAME, "leantrain", "train step", "memory", "GiB", "tokens", 2048, p50, config=config)

    merged = full.merge([row("a", 24.0, 1.0), row("a", 16.0, 2.0), row("b", 24.0, 3.0)], [row("a", 24.0, 9.0)])
    assert sorted((r.config["name"], r.config["cap_gib"], r.p50) for r in merged) == [
        ("a", 16.0, 2.0), ("a", 24.0, 9.0), ("b", 24.0, 3.0)
    ]  # fmt: skip


# -- the smoke runs ------------------------------------------------------------------------------------------------


def _env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env.update(
        BENCH_RESULTS=str(out), PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    )
    return env


@pytest.mark.slow
def test_one_run_in_process_unsloth_config_and_stock_experts():
    """The Unsloth configuration trains exactly r8 on q/k/v/o; stock LoRA on bf16 stacks makes expert adapters."""
    (unsloth,) = [r for r in full.plan("gpt-oss-20b", smoke=True) if r.name == "Unsloth notebook config"]
    result = full.run_one(unsloth, smoke=True)
    assert result["status"] == "ok", result.get("reason")
    assert result["arithmetic_matches_model"] and result["expert_adapter_values"] == 0
    assert result["moe4bit"].startswith("applied") and len(result["steps"]) == full.WARMUP + full.TIMED
    assert all(math.isfinite(loss) for loss in result["losses"])
    (stock,) = [r for r in full.plan("qwen3-30b-a3b", smoke=True) if r.name.startswith("stock attn+experts")]
    result = full.run_one(stock, smoke=True)
    assert result["status"] == "ok", result.get("reason")
    assert result["expert_adapter_values"] > 0 and result["arithmetic_matches_model"]
    assert "bf16 3-D stacks" == result["layout"] and "moe4bit" not in result


@pytest.mark.slow
def test_driver_smoke_writes_rows_table_and_plot(tmp_path):
    script = ROOT / "benchmarks" / "bench_moe4bit_full.py"
    cmd = [
        sys.executable,
        str(script),
        "--smoke",
        "--shape",
        "qwen3-30b-a3b",
        "--only",
        "attn+experts r<=16 adamw_8bit",
    ]
    proc = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads((tmp_path / f"{full.NAME}.json").read_text())
    assert {(r["metric"], r["x_value"]) for r in rows} == {(m, n) for m in ("memory", "speed") for n in (32, 64)}
    for r in rows:
        c = r["config"]
        assert c["status"] == "ok" and c["shape"] == "qwen3-30b-a3b" and c["cap_gib"] == 24.0, c.get("reason")
        assert c["arithmetic_matches_model"] and c["expert_adapter_values"] > 0 and c["rank"] == 16
        assert c["moe4bit"].startswith("applied") and "nf4 packed" in c["experts"]
        assert r["provider"] == "leantrain" and r["commit"] and r["versions"]["transformers"]
    assert (tmp_path / f"{full.NAME}.png").stat().st_size > 0
    md = (tmp_path / f"{full.NAME}.md").read_text()
    assert "attn+experts r<=16 adamw_8bit" in md and "fp32 AdamW (16 B/value)" in md


@pytest.mark.slow
def test_driver_records_a_crashed_run(tmp_path):
    bad = full.Run("bad", "no-such-shape", "leantrain", 32, None, "attention", 4, "adamw_torch")
    result = full.child(bad, smoke=True, timeout=300)
    assert result["status"] == "failed" and result["reason"].startswith("process exit code")
    (row,) = full.to_rows(result)
    assert row.metric == "memory" and math.isnan(row.p50) and row.config["status"] == "failed"
