"""benchmarks/bench_vs_unsloth.py: the variable-length data, the rows and table of records (fast), and the CPU smoke
run of its stock and leantrain providers in their own processes (Unsloth needs CUDA: its row says it was skipped)."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]

import bench_vs_unsloth as vs  # noqa: E402


# -- pure pieces (fast) --------------------------------------------------------------------------------------------


def test_varlen_rows_are_lognormal_clipped_and_the_same_in_every_process():
    pytest.importorskip("datasets")
    case = vs.cases(smoke=False)["llama-3.2-1b-varlen"]
    lengths = [len(row) for row in vs.dataset(case)["input_ids"]]
    assert len(lengths) == sum(case.steps) * case.batch  # one epoch: every provider trains on the same rows
    assert min(lengths) >= case.min_len and max(lengths) <= case.seq
    # lognormal sigma 0.8 around 500: the sample median of 132 rows stays well inside [400, 625] (its standard
    # error is ~1.25 * 0.8 / sqrt(132) = 9% in log space; the bounds are ~2.5 of those)
    assert 400 <= statistics.median(lengths) <= 625
    assert len(set(lengths)) > len(lengths) // 2  # really variable, not a handful of buckets
    assert [len(row) for row in vs.dataset(case)["input_ids"]] == lengths  # seeded


def _record(provider: str, ms: float, losses: list[float], status: str = "ok", reason: str = "") -> dict:
    if status != "ok":
        return {"case": "tiny-llama", "provider": provider, "status": status, "reason": reason}
    steps = [{"step": i + 1, "total_ms": ms, "tokens": 128, "padded_tokens": 128, "graphs": 0} for i in range(2)]
    return {
        "case": "tiny-llama", "provider": provider, "status": "ok", "reason": "", "device": "cpu",
        "versions": {"torch": "x"}, "steps": steps, "losses": losses, "peak_gib": 2.0, "first_step_s": 1.5,
        "cold_start_s": 9.0, "graphs_after_first_step": 0,
        "summary": {"p50": ms, "p20": ms, "p80": ms, "parts": {}, "tokens_per_s": 128 / ms * 1e3},
    }  # fmt: skip


def test_rows_and_table_carry_ratio_loss_gap_and_failure_reason():
    recs = [
        _record("stock", 200.0, [5.0, 4.0]),
        _record("leantrain", 100.0, [5.0, 4.25]),
        _record("unsloth", 0, [], status="failed", reason="InductorError: boom | at layer 3"),
    ]
    rows = vs.rows_of(recs, vs.cases(smoke=True))
    speed = {r.provider: r for r in rows if r.metric == "speed"}
    assert speed["leantrain"].config["max_abs_loss_diff_vs_stock"] == pytest.approx(0.25)
    (failed,) = [r for r in rows if r.provider == "unsloth"]
    assert failed.metric == "status" and math.isnan(failed.p50)
    text = vs.table(rows, ["tiny-llama"])
    assert "100.0 ms (2.00x), 2.00 GiB, first step 1.5 s (cold start 9 s)" in text and "200.0 ms (1.00x)" in text
    assert "failed: InductorError: boom / at layer 3" in text  # a "|" would break the markdown table
    assert text.splitlines()[-2].split("|")[2:4] == [" 0 ", " 0.25 "]


# -- the smoke run (one subprocess for the tests below) ------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, list[dict]]:
    for name in ("trl", "peft", "matplotlib", "datasets"):
        pytest.importorskip(name)
    out = tmp_path_factory.mktemp("vs_unsloth")
    return out, run_smoke(out, "tiny-llama,tiny-llama-varlen", "stock,leantrain,unsloth")


def run_smoke(out: Path, cases: str, providers: str, *extra: str) -> list[dict]:
    """``bench_vs_unsloth.py --smoke`` in its own process (no LEANTRAIN_ settings): the rows it wrote to ``out``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_vs_unsloth.py"), "--smoke", "--out", str(out),
               "--cases", cases, "--providers", providers, *extra]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "vs_unsloth.json").read_text())


def speed(rows: list[dict], case: str, provider: str) -> dict:
    (row,) = [r for r in rows if r["mode"] == case and r["provider"] == provider and r["metric"] == "speed"]
    return row


@pytest.mark.slow
def test_smoke_stock_and_leantrain_ran_and_agree_unsloth_skipped(smoke):
    out, rows = smoke
    for case in ("tiny-llama", "tiny-llama-varlen"):
        stock, mine = speed(rows, case, "stock")["config"], speed(rows, case, "leantrain")["config"]
        assert len(stock["losses"]) == 2 and all(math.isfinite(x) for x in stock["losses"])
        assert mine["report"] is not None and stock["report"] is None
        # fp32 on the CPU, the same data and LoRA init in both processes; leantrain's CPU defaults keep the stock
        # math or an fp32 reordering of it: 2e-5 relative is ~100 ulps (eps 1.2e-7) of a loss ~6
        assert mine["losses"] == pytest.approx(stock["losses"], rel=2e-5)
        # every trainer is told a user's run length and stopped after the case's steps (auto mode decides as for
        # a user; the two losses above are its 2 steps)
        assert stock["args"]["max_steps"] == mine["args"]["max_steps"] == str(vs.RUN_STEPS)
        (unsloth,) = [r for r in rows if r["mode"] == case and r["provider"] == "unsloth"]
        assert unsloth["metric"] == "status" and unsloth["config"]["reason"] == "Unsloth needs CUDA"
    for name in ("vs_unsloth.md", "vs_unsloth.png"):
        assert (out / name).stat().st_size > 0
    assert "tiny-llama-varlen" in (out / "vs_unsloth.md").read_text()


@pytest.mark.slow
def test_smoke_counts_every_real_token_once_and_only_real_tokens(smoke):
    _, rows = smoke
    for case_name in ("tiny-llama", "tiny-llama-varlen"):
        case = vs.cases(smoke=True)[case_name]
        real = sum(len(row) for row in vs.dataset(case)["input_ids"])
        for provider in ("stock", "leantrain"):
            config = speed(rows, case_name, provider)["config"]
            assert sum(config["real_tokens"]) == real  # one epoch: each row trained once, pads never counted
            padded = sum(config["padded_tokens"])
            assert padded == real if case.kind == "fixed" else padded > real
            # the step's own peak and the peak so far, per step: CUDA's allocator counters, none on the CPU
            nothing = [None] * len(config["real_tokens"])
            assert config["peak_so_far_gib"] == config["step_peak_gib"] == nothing


def test_table_lists_trainer_settings_unlike_stock_per_case():
    recs = [_record("stock", 200.0, [5.0, 4.0]), _record("unsloth", 150.0, [5.0, 4.1])]
    recs += [dict(r, case="tiny-llama-varlen") for r in recs]
    for r in recs:
        r["args"] = {"optim": "adamw_torch_fused", "padding_free": str(r["provider"] == "unsloth")}
        r["trainable"] = 100 if r["provider"] == "unsloth" and r["case"] == "tiny-llama" else 64
    line = vs.table(vs.rows_of(recs, vs.cases(smoke=True)), ["tiny-llama", "tiny-llama-varlen"]).splitlines()[-1]
    assert line.split("|")[2:4] == [" none ", " padding_free=True; trainable parameters=100 (tiny-llama) "]


@pytest.mark.slow
def test_smoke_moe_qlora_trains_with_leantrain(tmp_path):
    """The MoE QLoRA case on CPU (experts quantized by ``quantize_experts_4bit``, LoRA on their stacks): leantrain's
    auto mode serves the stacks, where PEFT's own forward fails by the second step."""
    for name in ("trl", "peft", "datasets", "bitsandbytes"):
        pytest.importorskip(name)
    row = speed(run_smoke(tmp_path, "tiny-moe-qlora", "leantrain"), "tiny-moe-qlora", "leantrain")
    assert all(math.isfinite(x) for x in row["config"]["losses"])
    (moe4bit,) = [o for o in row["config"]["report"]["outcomes"] if o["name"] == "moe4bit"]
    assert moe4bit["status"] == "applied"


def test_rounds_table_lists_each_run_of_one_case_in_its_order_and_the_header_the_told_run_length(tmp_path):
    import argparse

    runs = []
    for k, order in enumerate((("leantrain", "stock"), ("stock", "leantrain")), 1):
        recs = [_record(p, 100.0 * (i + 1) + k, [5.0, 4.0]) for i, p in enumerate(order)]
        for r in recs:
            r["args"] = {"max_steps": "1000"}
        recs[0]["to_last_step_s"] = 40.0 + k  # round k's first provider: process start to its last step
        out = tmp_path / f"r{k}"
        vs.write(recs, argparse.Namespace(smoke=True, out=str(out)))
        runs.append(str(out / "vs_unsloth.json"))
    assert "told: 1000 steps (tiny-llama)" in (tmp_path / "r1" / "vs_unsloth.md").read_text()
    kept = json.loads(Path(runs[0]).read_text())  # a provider of an earlier run, kept in the results file
    kept.append(dict(kept[0], provider="unsloth", date="2000-01-01T00:00:00+00:00"))
    Path(runs[0]).write_text(json.dumps(kept))
    vs.main(["--smoke", "--rounds", *runs, "--cases", "tiny-llama", "--out", str(tmp_path / "all")])
    text = (tmp_path / "all" / "vs_unsloth_rounds_tiny-llama.md").read_text()
    lines = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert [(int(a), b.strip()) for a, b in lines] == [(1, "leantrain"), (1, "stock"), (2, "stock"), (2, "leantrain")]
    assert "| 2 | leantrain | 202.0 (202.0-202.0) | 2.000 | 1.5 | – |" in text
    assert "| 2 | stock | 102.0 (102.0-102.0) | 2.000 | 1.5 | 42.0 (2) |" in text
    rows = json.loads((tmp_path / "all" / "vs_unsloth_rounds_tiny-llama.json").read_text())
    assert {r["config"]["round"] for r in rows} == {1, 2}
    with pytest.raises(SystemExit, match="one case"):
        vs.main(["--smoke", "--rounds", *runs, "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="no rows of tiny-llama-varlen"):
        vs.main(["--smoke", "--rounds", *runs, "--cases", "tiny-llama-varlen", "--out", str(tmp_path / "x")])


@pytest.mark.slow
def test_smoke_background_compile_records_its_children_and_the_time_to_the_last_step(tmp_path):
    """``leantrain_background`` (opt-in) with ``--timed-steps``: the run's step count follows it, and the record
    keeps the child's state and the time from process start to every step's end (the last one's as
    ``to_last_step_s``), what a background compile is judged by."""
    for name in ("trl", "peft", "datasets"):
        pytest.importorskip(name)
    rows = run_smoke(tmp_path, "tiny-llama", "leantrain_background", "--timed-steps", "4")
    config = speed(rows, "tiny-llama", "leantrain_background")["config"]
    assert len(config["losses"]) == vs.cases(smoke=True)["tiny-llama"].steps[0] + 4
    (compile_layers,) = [o for o in config["report"]["outcomes"] if o["name"] == "compile_layers"]
    assert compile_layers["status"] == "applied" and "child process" in compile_layers["detail"]
    background = config["background"]
    assert len(background["jobs"]) >= 1 and background["in_process"] == []
    assert 0 <= background["eager_steps"] < len(config["losses"])
    assert config["to_last_step_s"] > config["cold_start_s"] > 0
