"""benchmarks/bench_fused_ce.py on CPU: the smoke run writes its rows (the GPU run cannot die on a typo), providers
that cannot run are skipped with a note, and every provider computes the same loss (the benchmark times one
quantity)."""

from __future__ import annotations

import json

import bench_fused_ce as bench  # noqa: E402
import pytest
import torch


def test_smoke_writes_rows_and_notes(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    bench.main(["--smoke"])
    rows = json.loads((tmp_path / "fused_ce.json").read_text())
    md = (tmp_path / "fused_ce.md").read_text()
    speed = {(r["provider"], r["x_value"]) for r in rows if r["metric"] == "speed"}
    for head in ("frozen", "trainable"):
        for provider in ("gemm_floor", "stock", "leantrain"):
            assert (provider, f"tiny {head}") in speed
    assert {r["config"]["gemms"] for r in rows if r["provider"] == "gemm_floor"} == {2, 3}
    ratios = [r for r in rows if r["metric"] == "x_floor"]
    assert ratios and all(r["p50"] > 0 and r["config"]["floor_ms"] > 0 for r in ratios)
    # Liger's and CCE's kernels need CUDA: skipped with a note on CPU, never a crash
    assert "liger: skipped (needs CUDA)" in md and "cce: skipped (needs CUDA)" in md
    assert all(r["device"] and r["commit"] and r["versions"]["torch"] for r in rows)


def test_missing_peer_is_skipped_with_a_note(monkeypatch):
    monkeypatch.setattr(bench, "installed", lambda module: not module.startswith(("trl", "cut_cross")))
    found, notes = bench.providers("cuda")
    assert "trl_fused: skipped (trl.kernels.chunked_logprob is not installed)" in notes
    assert "cce: skipped (cut_cross_entropy is not installed)" in notes
    assert set(found) == {"stock", "leantrain", "liger"}


def test_installed_survives_a_missing_parent():
    assert bench.installed("torch") and not bench.installed("no_such_package_xyz.kernels")


def test_failing_provider_is_recorded_not_fatal(monkeypatch):
    def broken(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setitem(bench.PEERS, "cce", (broken, None, False))
    rows, md, _ = bench.run(smoke=True)
    assert "cce at tiny (H 32, V 1001) frozen: failed (OutOfMemoryError" in md
    assert not any(r.provider == "cce" for r in rows) and any(r.provider == "leantrain" for r in rows)


@pytest.mark.parametrize("trainable", [False, True])
def test_providers_compute_the_same_loss(trainable):
    """fp32 on CPU: stock, TRL's fused head (when installed) and leantrain agree on loss and gradients."""
    hidden, weight, targets, num_items = bench.make_inputs(48, 16, 301, "cpu", torch.float32)
    found, _ = bench.providers("cpu")
    results = {}
    for name, fn in found.items():
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(trainable)
        loss = fn(h, w, targets, num_items)
        loss.backward()
        results[name] = (loss.detach(), h.grad, w.grad)
    ref_loss, ref_h, ref_w = results.pop("stock")
    assert "leantrain" in results
    for name, (loss, grad_h, grad_w) in results.items():
        # fp32 sums over 301 logits and 42 rows: a few hundred roundings at most
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(grad_h, ref_h, rtol=1e-4, atol=1e-6, msg=name)
        if trainable:
            torch.testing.assert_close(grad_w, ref_w, rtol=1e-4, atol=1e-6, msg=name)
