"""benchmarks/dist_table.py on synthetic per-rank rows (the shape examples/_common.py writes): run names, the
row per run, agreement with stock, the markdown table and the files."""

from __future__ import annotations

import json
from pathlib import Path

import dist_table  # noqa: E402


def _report(applied=(), skipped=(), failed=()):
    outcomes = [{"name": n, "status": "applied", "reasons": []} for n in applied]
    outcomes += [{"name": n, "status": "skipped", "reasons": [why]} for n, why in skipped]
    outcomes += [{"name": n, "status": "failed", "reasons": [why]} for n, why in failed]
    return {"outcomes": outcomes}


def _rank(rank, step_ms, losses, kl=(), peak=1.5, report=None, tokens=8000, steps=4):
    return {
        "example": "x",
        "rank": rank,
        "world_size": 2,
        "distributed": "DistributedType.MULTI_GPU",
        "step_ms_p50": step_ms,
        "peak_gib": peak,
        "device": "NVIDIA H100 80GB HBM3",
        "losses": list(losses),
        "kl": list(kl),
        "num_tokens": tokens,
        "steps": steps,
        "report": report or _report(),
    }


def _write_run(root: Path, name: str, ranks: list[dict]) -> None:
    (root / name).mkdir(parents=True)
    for r in ranks:
        (root / name / f"x_rank{r['rank']}.json").write_text(json.dumps(r))


def _fixture(root: Path) -> None:
    _write_run(root, "sft.zero3.stock", [_rank(0, 100.0, [2.0, 1.0]), _rank(1, 110.0, [2.0, 1.0])])
    lean = _report(applied=["cggr"], skipped=[("moe4bit", "has no MoE experts module")])
    _write_run(root, "sft.zero3.leantrain", [_rank(0, 80.0, [2.0, 1.001], report=lean), _rank(1, 90.0, [2.0, 1.001])])
    grpo = _report(failed=[("grpo_logps", "RuntimeError: boom")])
    _write_run(root, "grpo.ddp.stock", [_rank(0, 50.0, [0.1], kl=[0.01]), _rank(1, 50.0, [0.1], kl=[0.01])])
    _write_run(root, "grpo.ddp.leantrain", [_rank(0, 40.0, [0.1], kl=[0.0125], report=grpo)])
    (root / "not_a_run").mkdir()
    (root / "not_a_run" / "x_rank0.json").write_text("{}")


def test_parse_run_names():
    assert dist_table.parse_run("sft_osft.fsdp2.leantrain") == ("sft_osft", "fsdp2", "leantrain")
    assert dist_table.parse_run("sft.zero2.stock") == ("sft", "zero2", "stock")
    assert dist_table.parse_run("sft.zero2") is None and dist_table.parse_run("sft.zero2.other") is None


def test_rows_per_run(tmp_path):
    _fixture(tmp_path)
    rows = {(r["recipe"], r["engine"], r["variant"]): r for r in dist_table.summarize(dist_table.load(tmp_path))}
    assert set(rows) == {
        ("sft", "zero3", "stock"),
        ("sft", "zero3", "leantrain"),
        ("grpo", "ddp", "stock"),
        ("grpo", "ddp", "leantrain"),
    }
    lean = rows[("sft", "zero3", "leantrain")]
    assert lean["step_ms_p50"] == 90.0  # the slowest rank
    assert lean["tokens_per_s_per_gpu"] == 8000 / 2 / 4 / 0.09  # global tokens / world / steps / step time
    assert lean["peak_gib_per_rank"] == [1.5, 1.5] and lean["ranks_reported"] == 2
    assert lean["applied"] == ["cggr"] and lean["declined"] == ["moe4bit: has no MoE experts module"]
    assert abs(lean["loss_max_rel_diff_vs_stock"] - 1e-3) < 1e-12
    assert rows[("sft", "zero3", "stock")]["loss_max_rel_diff_vs_stock"] is None
    grpo = rows[("grpo", "ddp", "leantrain")]
    assert grpo["failed"] == ["grpo_logps: RuntimeError: boom"] and grpo["ranks_reported"] == 1
    assert abs(grpo["kl_max_abs_diff_vs_stock"] - 0.0025) < 1e-12 and grpo["loss_max_rel_diff_vs_stock"] == 0.0


def test_markdown_and_files(tmp_path):
    _fixture(tmp_path / "in")
    out = tmp_path / "out"
    assert dist_table.main([str(tmp_path / "in"), "--out", str(out), "--commit", "abc1234"]) == 0
    (json_path,) = out.glob("dist_*_abc1234.json")
    data = json.loads(json_path.read_text())
    assert data["meta"]["commit"] == "abc1234" and data["meta"]["device"] == "NVIDIA H100 80GB HBM3"
    assert {"torch", "transformers", "trl"} <= set(data["meta"]["versions"]) and len(data["rows"]) == 4
    md = json_path.with_suffix(".md").read_text()
    assert "Device: NVIDIA H100 80GB HBM3 x 2" in md and "abc1234" in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4 and all(line.count("|") == table[0].count("|") for line in table)
    assert "nan" not in md and "FAILED grpo_logps" in md
    # a decline that only says "not for this recipe" stays in the rows, out of the table
    assert "has no MoE experts module" not in md
    assert any("moe4bit: has no MoE experts module" in r["declined"] for r in data["rows"])


def test_nothing_to_summarize(tmp_path):
    assert dist_table.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 1


def test_opt_in_recipes_compare_with_the_recipe_they_modify(tmp_path):
    """osft / cggr have no stock launch: their baseline is sft_full's stock run of the same engine, and their loss
    difference is reported but never judged against the rounding bound (they change what trains)."""
    _write_run(tmp_path, "sft_full.ddp.stock", [_rank(0, 100.0, [2.0, 1.0]), _rank(1, 100.0, [2.0, 1.0])])
    _write_run(tmp_path, "cggr.ddp.leantrain", [_rank(0, 80.0, [2.0, 1.5]), _rank(1, 50.0, [2.0, 1.5])])
    _write_run(tmp_path, "osft.fsdp2.leantrain", [_rank(0, 80.0, [2.0, 1.5])])  # no sft_full.fsdp2.stock
    rows = {(r["recipe"], r["engine"]): r for r in dist_table.summarize(dist_table.load(tmp_path))}
    cggr = rows[("cggr", "ddp")]
    assert cggr["stock_run"] == "sft_full.ddp.stock" and cggr["step_ratio_vs_stock"] == 100.0 / 80.0
    assert abs(cggr["loss_max_rel_diff_vs_stock"] - 0.5) < 1e-12 and cggr["loss_within_bound"] is None
    assert rows[("osft", "fsdp2")]["loss_max_rel_diff_vs_stock"] is None


def test_loss_bound_is_compares_bound(tmp_path):
    """A default optimization's losses are judged per step against leantrain compare's bound, from stock's losses,
    the run's dtype and layer count: 8 u sqrt(2L+2) (|loss_k| + movement so far); bf16, L=2: 8 * 2^-8 * sqrt(6)."""
    from leantrain.cli.verdict import loss_bounds

    stock = [_rank(0, 100.0, [2.0, 1.0]) | {"dtype": "bf16", "layers": 2}]
    (b1, b2) = loss_bounds([2.0, 1.0], "bf16", 2)
    assert abs(b1 - 2.0 * 8 * 2**-8 * 6**0.5) < 1e-12 and abs(b2 - (1.0 + 1.0) * 8 * 2**-8 * 6**0.5) < 1e-12
    _write_run(tmp_path, "sft_lora.ddp.stock", stock)
    _write_run(tmp_path, "sft_lora.ddp.leantrain", [_rank(0, 90.0, [2.0 + 0.99 * b1, 1.0 - 0.99 * b2])])
    _write_run(tmp_path, "sft_full.ddp.stock", stock)
    _write_run(tmp_path, "sft_full.ddp.leantrain", [_rank(0, 90.0, [2.0, 1.0 + 1.01 * b2])])
    rows = {(r["recipe"], r["variant"]): r for r in dist_table.summarize(dist_table.load(tmp_path))}
    assert rows[("sft_lora", "leantrain")]["loss_within_bound"] is True
    assert rows[("sft_full", "leantrain")]["loss_within_bound"] is False
    assert "(NO)" in dist_table.markdown([rows[("sft_full", "leantrain")]])


def test_failed_and_skipped_launches_get_rows(tmp_path):
    """launches.tsv (gpu_dist.sh) adds a row for a launch that left no rank rows: failed with its last error line,
    or skipped by the time budget; a launch that did leave rows is not listed twice."""
    _fixture(tmp_path)
    (tmp_path / "launches.tsv").write_text(
        "run\trc\tseconds\twhy\n"
        "sft.zero3.stock\t0\t30\t\n"
        "grpo.zero2.stock\t1\t25\tRuntimeError: NCCL error\n"
        "grpo.zero3.leantrain\tskipped\t0\ttime budget\n"
        "grpo.ddp.leantrain\t1\t30\tsomething after the rows were written\n"
    )
    rows = dist_table.launch_rows(tmp_path, set(dist_table.load(tmp_path)))
    assert [(r["recipe"], r["engine"], r["variant"]) for r in rows] == [
        ("grpo", "zero2", "stock"),
        ("grpo", "zero3", "leantrain"),
    ]
    assert rows[0]["failed"] == ["launch failed (rc 1): RuntimeError: NCCL error"]
    assert rows[1]["failed"] == ["skipped: time budget"]
    out = tmp_path / "out"
    assert dist_table.main([str(tmp_path), "--out", str(out), "--commit", "c"]) == 0
    md = next(out.glob("*.md")).read_text()
    assert "FAILED launch failed (rc 1): RuntimeError: NCCL error" in md and "FAILED skipped: time budget" in md


def test_several_calls_directories(tmp_path):
    """Two device calls' tarballs, each in its own directory: a launch that failed in the first and ran in the
    second gets the second's row, never a failure row besides it."""
    first, second = tmp_path / "d1", tmp_path / "d2"
    _write_run(first, "sft_full.ddp.stock", [_rank(0, 100.0, [2.0, 1.0])])
    (first / "launches.tsv").write_text("run\trc\tseconds\twhy\nsft_full.ddp.leantrain\tskipped\t0\ttime budget\n")
    _write_run(second, "sft_full.ddp.leantrain", [_rank(0, 50.0, [2.0, 1.0])])
    out = tmp_path / "out"
    assert dist_table.main([str(first), str(second), "--out", str(out), "--commit", "c"]) == 0
    rows = json.loads(next(out.glob("*.json")).read_text())["rows"]
    assert [(r["variant"], r["step_ms_p50"], r["failed"]) for r in rows] == [
        ("leantrain", 50.0, []),
        ("stock", 100.0, []),
    ]
    assert rows[0]["step_ratio_vs_stock"] == 2.0


def test_compatibility_engines_section_from_the_newest_gpu_table(tmp_path, monkeypatch):
    """.ci/compat_table.py's engines section names, per engine, what the newest GPU table ran and what applied or
    declined there; a CPU table (the smoke) never counts; with no GPU table it keeps the runs listed by hand."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "compat_table", Path(dist_table.__file__).parents[1] / ".ci" / "compat_table.py"
    )
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)
    monkeypatch.setattr(compat, "DIST_RESULTS", tmp_path / "results")
    assert "2x H200 (NCCL) on 2026-11-24" in "\n".join(compat.engines())
    _fixture(tmp_path / "in")
    (tmp_path / "in" / "launches.tsv").write_text("run\trc\tseconds\twhy\ngrpo.zero2.leantrain\t1\t9\tboom\n")
    assert dist_table.main([str(tmp_path / "in"), "--out", str(tmp_path / "results"), "--commit", "c"]) == 0
    lines = {line.split(" | ")[0]: line for line in compat.engines() if line.startswith("| ")}
    assert "2x NVIDIA H100 80GB HBM3 on " in lines["| DeepSpeed ZeRO-3"]
    assert "sft (cggr)" in lines["| DeepSpeed ZeRO-3"]  # "has no MoE experts" is not a decline worth naming
    assert "grpo (nothing applied; failed: grpo_logps)" in lines["| DDP"]  # it fell back at run time
    assert "grpo (did not run)" in lines["| DeepSpeed ZeRO-2"] and lines["| FSDP2"].endswith("| not run |")


def test_versions_are_the_runs_own(tmp_path):
    """A table made on another machine than the runs (the fetched tarball, tabled locally) names the versions the
    runs trained with, not the local ones."""
    gpu = {"torch": "2.11.0+cu130", "transformers": "5.23.0"}
    _write_run(tmp_path / "in", "sft_full.ddp.stock", [_rank(0, 100.0, [2.0]) | {"versions": gpu}])
    out = tmp_path / "out"
    assert dist_table.main([str(tmp_path / "in"), "--out", str(out), "--commit", "c"]) == 0
    data = json.loads(next(out.glob("*.json")).read_text())
    assert data["meta"]["versions"] == gpu and "torch 2.11.0+cu130" in next(out.glob("*.md")).read_text()
