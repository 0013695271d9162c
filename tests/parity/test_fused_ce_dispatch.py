"""The fused loss's dispatch rule: no cell, no op (any path, any device class), measured cells on their own device
class only, the reach of a cell, and the table the kernel benchmark emits from its rows (round trip through the
Python source it prints)."""

from __future__ import annotations

import pytest

from leantrain.fused_ce import dispatch
from leantrain.fused_ce.dispatch import Measured, choose, device_class, emit_rule, measured_from_rows


def cell(path="trl_fused", head="frozen", n=8192, h=2304, v=256000, device="cuda", stock=47.7, ours=33.7):
    return Measured(path, head, n, h, v, "bfloat16", device, stock, ours)


@pytest.mark.parametrize("path", dispatch.PATHS)
def test_unmeasured_is_the_stock_loss_on_every_path(path):
    verdict, why = choose(path, "frozen", 2304, 256000, "bfloat16", (), device="cuda")
    assert verdict == "stock" and why.startswith("not measured on cuda") and why.endswith("the stock loss")
    verdict, why = choose(path, "frozen", 2304, 256000, "bfloat16", [cell(path)], device="cuda")
    assert verdict == "leantrain" and "measured at H=2304 V=256000 bfloat16 on cuda" in why


def test_a_cell_never_decides_for_another_device_class():
    """A CPU run never matches the CUDA cells, the shipped table's included: the stock loss, and the reason says
    where it was measured."""
    verdict, why = choose("full_logits", "frozen", 2304, 256000, "bfloat16", [cell("full_logits")], device="cpu")
    assert (verdict, why.split(" (")[0]) == ("stock", "not measured on cpu")
    assert "measured on cuda only" in why and why.endswith(": the stock loss")
    for path in dispatch.PATHS:  # the shipped table: CUDA cells only
        assert choose(path, "frozen", 4096, 128256, "bfloat16", device="cpu")[0] == "stock"
    assert dispatch.device_reason("cpu") is not None and dispatch.device_reason("cuda") is None
    # a CPU cell decides on CPU, and only there
    cpu = [cell("full_logits", device="cpu")]
    assert choose("full_logits", "frozen", 2304, 256000, "bfloat16", cpu, device="cpu")[0] == "leantrain"
    assert choose("full_logits", "frozen", 2304, 256000, "bfloat16", cpu, device="cuda")[0] == "stock"


def test_measured_cell_decides_within_reach():
    cells = [
        cell(),
        cell(n=16384, stock=95.0, ours=70.0),
        cell(h=1536, v=151936, stock=20.1, ours=19.9),  # a tie: within the noise
    ]

    def pick(head="frozen", h=2304, v=256000, dtype="bfloat16"):
        return choose("trl_fused", head, h, v, dtype, cells, device="cuda")

    assert pick()[0] == "leantrain"
    assert pick(h=2048, v=262144)[0] == "leantrain"  # nearest cell
    assert pick(h=1536, v=151936)[0] == "stock"
    verdict, why = pick(h=8192)  # beyond reach: not measured, the stock loss
    assert verdict == "stock" and why == "not measured at H=8192 V=256000 bfloat16 frozen head on cuda: the stock loss"
    assert pick(head="trainable")[0] == "stock"  # other head: not measured
    assert pick(dtype="float32")[0] == "stock"  # other dtype: not measured


def test_one_slower_n_keeps_stock():
    cells = [
        cell("full_logits", "trainable", stock=60.0, ours=50.0),
        cell("full_logits", "trainable", n=1024, stock=8.0, ours=8.5),
    ]
    verdict, why = choose("full_logits", "trainable", 2304, 256000, "bfloat16", cells, device="cuda")
    assert verdict == "stock" and "N 1024/8192" in why


def test_rows_to_rule_round_trip():
    def row(provider, n, head, p50):
        return {
            "benchmark": "fused_ce",
            "provider": provider,
            "metric": "speed",
            "p50": p50,
            "config": {"N": n, "H": 2304, "V": 256000, "dtype": "bfloat16", "head": head},
            "device": "NVIDIA H100 80GB HBM3",
        }

    rows = [
        row("leantrain", 8192, "frozen", 33.7),
        row("trl_fused", 8192, "frozen", 47.7),
        row("stock", 8192, "frozen", 61.0),
        row("liger", 8192, "frozen", 101.0),  # a peer: not a path's stock
        row("trl_fused", 8192, "trainable", 66.6),  # no leantrain cell: dropped
        {"provider": "leantrain", "metric": "memory", "p50": 1.0, "config": {}},
        {**row("leantrain", 8192, "frozen", 900.0), "device": "cpu (x86_64, 2 cores)"},  # a CPU run: its own cell
        {**row("stock", 8192, "frozen", 800.0), "device": "cpu (x86_64, 2 cores)"},
    ]
    cells = measured_from_rows(rows)
    assert sorted(cells) == sorted(
        [
            cell("trl_fused", stock=47.7, ours=33.7),
            cell("full_logits", stock=61.0, ours=33.7),
            cell("full_logits", device="cpu", stock=800.0, ours=900.0),
        ]
    )
    source = emit_rule(cells, "NVIDIA H100 80GB HBM3, 2026-11-26, benchmarks/results/fused_ce.json")
    namespace = {"Measured": Measured}
    exec(source, namespace)
    assert namespace["SOURCE"].startswith("NVIDIA H100")
    assert sorted(namespace["MEASURED"]) == sorted(cells)


def test_unknown_path_or_head_raises():
    with pytest.raises(ValueError, match="unknown path"):
        choose("nll", "frozen", 1, 1, "float32", (), device="cuda")


def test_a_row_without_a_device_raises():
    assert device_class({"device": "cpu (x86_64, 2 cores)"}) == "cpu"
    assert device_class({"device": "NVIDIA H200"}) == "cuda"
    with pytest.raises(ValueError, match="without a device"):
        device_class({"provider": "leantrain"})


def test_the_module_table_is_well_formed():
    for m in dispatch.MEASURED:
        assert m.path in dispatch.PATHS and m.head in dispatch.HEADS and m.stock_ms > 0 and m.leantrain_ms > 0
        assert m.device in ("cuda", "cpu")


def test_the_kernel_benchmark_rows_give_the_rule(tmp_path, monkeypatch):
    """benchmarks/bench_fused_ce.py --smoke (CPU) writes rows this module reads: the GPU run's table can be pasted."""
    import json
    import subprocess
    import sys

    import bench_fused_ce

    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    bench_fused_ce.main(["--smoke"])
    path = tmp_path / "fused_ce.json"
    cells = measured_from_rows(json.loads(path.read_text()))
    assert {(c.path, c.head) for c in cells} >= {("full_logits", "frozen"), ("full_logits", "trainable")}
    printed = subprocess.run(
        [sys.executable, "-m", "leantrain.fused_ce.dispatch", str(path)], capture_output=True, text=True, check=True
    ).stdout
    namespace = {"Measured": Measured}
    exec(printed, namespace)
    assert sorted(namespace["MEASURED"]) == sorted(cells)
