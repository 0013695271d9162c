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
    assert "nan" not in md and "FAILED grpo_logps" in md and "moe4bit: has no MoE experts module" in md


def test_nothing_to_summarize(tmp_path):
    assert dist_table.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 1
