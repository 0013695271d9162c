"""benchmarks/bench_grpo_logps.py: the GEMM floor and achieved-TFLOP/s columns (issue #13's ratio to the floor), and
the no-grad grid with the rule it checks (--nograd, --emit-rule)."""

from __future__ import annotations

import json

import bench_grpo_logps as bench  # noqa: E402
import pytest
import torch


def test_gemm_count_and_tflops():
    assert [bench.gemm_count(m, tr) for m, tr in (("forward", False), ("full", False), ("full", True))] == [1, 2, 3]
    # the README's anchor: two N*H*V GEMMs at N=8192, H=2048, V=151936 in 12.9 ms is ~790 TFLOP/s
    assert bench.tflops(8192, 2048, 151936, "full", False, 12.9) == pytest.approx(790.0, rel=2e-3)


@pytest.mark.parametrize("mode, trainable", [("forward", False), ("full", False), ("full", True)])
def test_gemm_floor_runs(mode, trainable):
    hidden, weight = torch.randn(16, 8), torch.randn(32, 8)
    timing = bench.gemm_floor(hidden, weight, mode, trainable, reps=2, warmup=1)
    assert timing.p50 > 0 and len(timing.samples) == 2


def test_keep_provider_only_in_trainable_rows(monkeypatch):
    """leantrain_triton_keep (issue #13) is timed next to the others in the trainable-head row and nowhere else."""
    monkeypatch.setattr(bench.ops, "triton_available", lambda: True)
    names = list(bench.providers("cuda"))  # CUDA's list; nothing is called
    assert "leantrain_triton_keep" in names
    trainable = [n for n in names if bench.runs_in_case(n, True)]
    frozen = [n for n in names if bench.runs_in_case(n, False)]
    assert {"leantrain_triton", "leantrain_triton_keep", "trl_chunked", "materialized"} <= set(trainable)
    assert "leantrain_triton_keep" not in frozen and "leantrain_triton" in frozen
    assert "leantrain_triton_keep" not in bench.providers("cpu")


def test_keep_provider_keeps_the_logits():
    """The provider's budget keeps a trainable head's logits (checked through the torch backend on CPU)."""
    run = bench.leantrain_backend("torch", bench.KEEP_ALL_MIB)
    hidden, weight = torch.randn(16, 8), torch.randn(32, 8).requires_grad_()
    logp, _ = run(hidden, weight, torch.randint(0, 32, (16,)))
    assert logp.grad_fn.kept_logits is not None


def test_default_provider_only_in_no_grad_forward_rows(monkeypatch):
    """leantrain_default (issue #28): what the patched trainer runs, timed in the no-grad forward rows only."""
    monkeypatch.setattr(bench.ops, "triton_available", lambda: True)
    names = list(bench.providers("cuda"))
    assert "leantrain_default" in names and "leantrain_default" in bench.providers("cpu")
    assert bench.runs_in_case("leantrain_default", False, "forward")
    assert not bench.runs_in_case("leantrain_default", False, "full")
    assert not bench.runs_in_case("leantrain_default", True, "full")
    assert not bench.runs_in_case("leantrain_default", False)  # the parity pass (with gradients)


@pytest.mark.parametrize("stock", [False, True])
def test_default_provider_takes_the_trainers_decision(monkeypatch, stock):
    """leantrain_default asks the no-grad rule, as the trainer's forward: TRL's head under no_grad where the rule says
    so (bitwise TRL's output then), leantrain's op otherwise and with a gradient."""
    from leantrain.grpo_logps import nograd

    seen = []

    def rule(v, backend):
        seen.append((v, backend))
        return stock

    monkeypatch.setattr(nograd, "trl_head_serves", rule)
    used = []
    monkeypatch.setattr(bench, "trl_chunked", lambda *a: used.append("trl") or (torch.zeros(16), None))
    hidden, weight, targets = torch.randn(16, 8), torch.randn(32, 8), torch.randint(0, 32, (16,))
    with torch.no_grad():
        logp, _ = bench.leantrain_default(hidden, weight, targets)
    assert seen == [(32, "torch")]
    assert used == (["trl"] if stock else [])
    assert stock or logp.abs().sum() > 0  # leantrain's op ran (log-probs of a 32-way softmax are < 0)
    h = hidden.clone().requires_grad_()
    logp, _ = bench.leantrain_default(h, weight, targets)
    assert used == (["trl"] if stock else []) and logp.requires_grad  # with a gradient: the op
    assert len(seen) == 1  # the rule was not asked


def test_trl_chunked_is_trls_fused_head_call():
    """The provider calls what TRL's fused forward looks up (function and chunk size), with the outputs asked."""
    from trl.trainer import utils as trl_utils

    hidden, weight, targets = torch.randn(16, 8), torch.randn(32, 8), torch.randint(0, 32, (16,))
    ref = trl_utils._ChunkedLogProbFunction.apply(
        hidden, weight, None, targets, bench.TEMPERATURE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
        ("log_probs",),
    )  # fmt: skip
    logp, entropy = bench.trl_chunked(hidden, weight, targets, outputs=("log_probs",))
    assert torch.equal(logp, ref[0]) and entropy is None
    assert bench.trl_chunked(hidden, weight, targets)[1] is not None


# ------------------------------------------------------------------------------------- --nograd, --emit-rule
def test_nograd_smoke_and_emitted_rule(tmp_path, monkeypatch, capsys):
    """--nograd --smoke runs on CPU and writes the rows; --emit-rule checks them against the no-grad rule: it prints
    the rule's constants where TRL's head won or tied every cell, and exits naming a cell where leantrain's op won."""
    from leantrain.grpo_logps import nograd

    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    monkeypatch.setattr(bench, "NOGRAD_SMOKE_MODELS", [("tiny", 16, 257)])
    monkeypatch.setattr(bench, "NOGRAD_SMOKE_N", (8, 32))
    bench.main(["--nograd", "--smoke"])
    rows = bench.read_rows(tmp_path / "grpo_logps_nograd.json")
    speed = [r for r in rows if r.metric == "speed"]
    assert len(speed) == 2 * 2 * 2 and {r.provider for r in speed} == {bench.STOCK, bench.FUSED}
    assert {(r.x_value, r.config["entropy"]) for r in speed} == {(n, e) for n in (8, 32) for e in (True, False)}
    assert all(r.device and r.versions and r.date and r.commit for r in rows)
    assert "| rule now |" in (tmp_path / "grpo_logps_nograd.md").read_text()
    data = json.loads((tmp_path / "grpo_logps_nograd.json").read_text())

    def emitted(fused_ms) -> str:
        """--emit-rule on the smoke rows with TRL's head at 1 ms and leantrain's op at ``fused_ms(config)``."""
        for row in data:
            if row["metric"] == "speed":
                row["p50"] = 1.0 if row["provider"] == bench.STOCK else fused_ms(row["config"])
        path = tmp_path / "edited.json"
        path.write_text(json.dumps(data))
        capsys.readouterr()
        bench.main(["--emit-rule", str(path)])
        return capsys.readouterr().out

    scope: dict = {}
    exec(emitted(lambda c: 1.0 - nograd.NOISE / 2 if c["N"] == 8 else 1.5), scope)  # ties and TRL's wins
    assert scope["MEASURED_V"] == (257, 257) and "grpo_logps_nograd.json" in scope["SOURCE"]
    with pytest.raises(SystemExit, match="at N=32 H=16 V=257 bfloat16 entropy=False: "):
        emitted(lambda c: 1.0 - 2 * nograd.NOISE if (c["N"], c["entropy"]) == (32, False) else 1.0)


def test_emit_rule_without_nograd_rows_says_what_to_run(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[]")
    with pytest.raises(SystemExit, match="run `python benchmarks/bench_grpo_logps.py --nograd` first"):
        bench.main(["--emit-rule", str(path)])


def test_committed_results_emit_the_rule_in_the_package(capsys):
    """The rule in grpo_logps/nograd.py is what --emit-rule derives from benchmarks/results/grpo_logps_nograd.json."""
    from leantrain.grpo_logps import nograd

    bench.main(["--emit-rule", str(bench.RESULTS / "grpo_logps_nograd.json")])
    scope: dict = {}
    exec(capsys.readouterr().out, scope)
    assert (scope["SOURCE"], scope["MEASURED_V"]) == (nograd.SOURCE, nograd.MEASURED_V)


def test_nograd_grid_covers_the_recipe_shapes():
    assert {(h, v) for _, h, v in bench.NOGRAD_MODELS} == {
        (896, 151936), (1536, 151936), (2048, 151936), (3584, 152064), (5120, 152064), (4096, 128256),
    }  # fmt: skip
    assert bench.NOGRAD_N == (1024, 2048, 4096, 8192, 16384)
