"""``bash benchmarks/gpu_dist.sh --smoke``: the two-GPU benchmark's plumbing on CPU (2 processes, gloo, tiny model,
torchrun standing in for accelerate launch) down to its rows, launches.tsv and markdown table: dense LoRA SFT stock
vs leantrain, full SFT stock, and CGGR (opt-in, no stock launch of its own: compared with full SFT's stock run).
About 2 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None, reason="needs bash and setsid")
def test_gpu_dist_smoke(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    pytest.importorskip("peft")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable, BENCH_COMMIT="smoke")
    result = subprocess.run(
        ["bash", "benchmarks/gpu_dist.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (rows_path,) = (tmp_path / "dist" / "results").glob("dist_cpu*_smoke.json")
    rows = {(r["recipe"], r["variant"]): r for r in json.loads(rows_path.read_text())["rows"]}
    assert set(rows) == {
        ("sft_lora", "stock"),
        ("sft_lora", "leantrain"),
        ("sft_full", "stock"),
        ("cggr", "leantrain"),
    }
    assert all(r["applied"] == [] for key, r in rows.items() if key != ("cggr", "leantrain"))
    assert rows[("cggr", "leantrain")]["applied"] == ["cggr"]
    assert rows[("cggr", "leantrain")]["stock_run"] == "sft_full.ddp.stock"
    for row in rows.values():
        assert row["world_size"] == 2 and row["ranks_reported"] == 2 and row["step_ms_p50"] > 0
        assert row["tokens_per_s_per_gpu"] > 0 and row["losses"]
    lora = rows[("sft_lora", "leantrain")]
    # nothing applies to a tiny fp32 model on CPU: the losses are stock's to the bit, so within any bound
    assert lora["loss_max_rel_diff_vs_stock"] == 0.0 and lora["loss_within_bound"] is True
    launches = (tmp_path / "launches.tsv").read_text().splitlines()
    assert launches[0] == "run\trc\tseconds\twhy" and len(launches) == 1 + 4
    # exit 0, or an error after every rank wrote its row (a gloo rank aborting at exit), which the script notes
    assert all(rc == "0" or "(teardown)" in why for _, rc, _, why in (line.split("\t") for line in launches[1:]))
    assert (tmp_path / "dist.tgz").stat().st_size > 0
    assert "| sft_lora | ddp | leantrain |" in (tmp_path / "dist_table.md").read_text()


def smoke_rows(out: Path, selection: list[str], timeout: int = 600, **environ: str) -> list[dict]:
    """``gpu_dist.sh --smoke`` on ``selection`` with ``environ`` added to every launch's environment: its rows."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env.update(OUT=str(out), PYTHON=sys.executable, BENCH_COMMIT="smoke", **environ)
    result = subprocess.run(
        ["bash", "benchmarks/gpu_dist.sh", "--smoke", *selection],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (rows_path,) = (out / "dist" / "results").glob("dist_cpu*_smoke.json")
    return json.loads(rows_path.read_text())["rows"]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None, reason="needs bash and setsid")
def test_gpu_dist_smoke_grpo_osft_moe(tmp_path):
    """The other recipes' plumbing, one leantrain launch each: GRPO (fused log-probs), OSFT (opt-in through the
    environment) and MoE QLoRA (train_sft.py --moe-4bit: nf4 experts, LoRA on attention; moe4bit applies at patch
    time; on CPU accelerate's prepare copies the model and the grouped path falls back once, see
    test_moe4bit_distributed.py). Neither the fused log-probs nor the grouped experts are measured faster on these
    tiny CPU runs, so auto mode keeps the stock paths: those launches ask for them through the environment, as a user
    would (each in its own call: a request for an optimization that does not apply to a recipe is an error)."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    rows = {r["recipe"]: r for r in smoke_rows(tmp_path / "grpo", ["grpo.ddp.leantrain"], LEANTRAIN_GRPO_LOGPS="1")}
    rows |= {r["recipe"]: r for r in smoke_rows(tmp_path / "osft", ["osft.ddp.leantrain"])}
    moe = smoke_rows(tmp_path / "moe", ["moe_qlora.ddp.leantrain"], LEANTRAIN_MOE4BIT="1")
    rows |= {r["recipe"]: r for r in moe}
    assert set(rows) == {"grpo", "osft", "moe_qlora"}
    assert rows["grpo"]["applied"] == ["grpo_logps"] and rows["osft"]["applied"] == ["osft"]
    moe = rows["moe_qlora"]
    fallback = "moe4bit: run-time fallback to stock: RuntimeError: packed expert stacks were moved"
    assert moe["applied"] == ["moe4bit"] or moe["failed"][0].startswith(fallback), moe
    for row in rows.values():
        assert row["ranks_reported"] == 2 and row["losses"]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None, reason="needs bash and setsid")
def test_gpu_dist_smoke_accelerate_configs(tmp_path):
    """The GPU path's launcher: ``accelerate launch`` with examples/accelerate/fsdp2.yaml and the DeepSpeed configs
    (SMOKE_ENGINES; fp32, DeepSpeed's CPU accelerator): dense LoRA SFT with the FSDP2 config, GRPO under ZeRO-2
    (fused log-probs apply) and MoE QLoRA under ZeRO-3, where moe4bit declines with the reason a user can act on."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    # a first DeepSpeed CPU launch on a machine compiles DeepSpeed's shared-memory op (1-2 min on 2 busy cores)
    engines = dict(SMOKE_ENGINES="fsdp2 zero2 zero3", LAUNCH_TIMEOUT="400", BUDGET="1500")
    selection = ["sft_lora.fsdp2.leantrain", "moe_qlora.zero3.leantrain"]
    rows = {(r["recipe"], r["engine"]): r for r in smoke_rows(tmp_path / "sft", selection, 1500, **engines)}
    # the fused log-probs are not measured faster on CPU: the GRPO launch asks for them, as a user would
    grpo = smoke_rows(tmp_path / "grpo", ["grpo.zero2.leantrain"], 1500, LEANTRAIN_GRPO_LOGPS="1", **engines)
    rows |= {(r["recipe"], r["engine"]): r for r in grpo}
    assert set(rows) == {("sft_lora", "fsdp2"), ("grpo", "zero2"), ("moe_qlora", "zero3")}
    # accelerate runs fsdp2.yaml on CPU processes as plain multi-CPU data parallel (FSDP2 on gloo is covered by
    # test_trainers_distributed.py's own workers): here the config parses and the launch goes through
    assert rows[("sft_lora", "fsdp2")]["distributed"] == "DistributedType.MULTI_CPU"
    assert rows[("grpo", "zero2")]["applied"] == ["grpo_logps"]
    assert rows[("grpo", "zero2")]["distributed"] == "DistributedType.DEEPSPEED"
    (moe,) = [d for d in rows[("moe_qlora", "zero3")]["declined"] if d.startswith("moe4bit:")]
    assert "ZeRO-3 partitions every parameter" in moe and "use ZeRO-2" in moe
    for row in rows.values():
        assert row["ranks_reported"] == 2 and row["losses"]
