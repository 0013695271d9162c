"""The fused loss's dispatch rule: unmeasured defaults, measured cells, the reach of a cell, and the table the kernel
benchmark emits from its rows (round trip through the Python source it prints)."""

from __future__ import annotations

import pytest

from leantrain.fused_ce import dispatch
from leantrain.fused_ce.dispatch import Measured, choose, emit_rule, measured_from_rows


def test_unmeasured_defaults():
    assert choose("trl_fused", "frozen", 2304, 256000, "bfloat16", ())[0] == "stock"
    assert choose("chunked_nll", "frozen", 2304, 256000, "bfloat16", ())[0] == "leantrain"
    verdict, why = choose("full_logits", "trainable", 2304, 256000, "bfloat16", ())
    assert verdict == "leantrain" and "not measured" in why


def test_measured_cell_decides_within_reach():
    cells = [
        Measured("trl_fused", "frozen", 8192, 2304, 256000, "bfloat16", 47.7, 33.7),
        Measured("trl_fused", "frozen", 16384, 2304, 256000, "bfloat16", 95.0, 70.0),
        Measured("trl_fused", "frozen", 8192, 1536, 151936, "bfloat16", 20.1, 19.9),  # a tie: within the noise
    ]
    assert choose("trl_fused", "frozen", 2304, 256000, "bfloat16", cells)[0] == "leantrain"
    assert choose("trl_fused", "frozen", 2048, 262144, "bfloat16", cells)[0] == "leantrain"  # nearest cell
    assert choose("trl_fused", "frozen", 1536, 151936, "bfloat16", cells)[0] == "stock"
    assert choose("trl_fused", "frozen", 8192, 256000, "bfloat16", cells)[0] == "stock"  # beyond reach: default
    assert choose("trl_fused", "trainable", 2304, 256000, "bfloat16", cells)[0] == "stock"  # other head: default
    assert choose("trl_fused", "frozen", 2304, 256000, "float32", cells)[0] == "stock"  # other dtype: default


def test_one_slower_n_keeps_stock():
    cells = [
        Measured("full_logits", "trainable", 8192, 2304, 256000, "bfloat16", 60.0, 50.0),
        Measured("full_logits", "trainable", 1024, 2304, 256000, "bfloat16", 8.0, 8.5),
    ]
    verdict, why = choose("full_logits", "trainable", 2304, 256000, "bfloat16", cells)
    assert verdict == "stock" and "N 1024/8192" in why


def test_rows_to_rule_round_trip():
    def row(provider, n, head, p50):
        return {
            "benchmark": "fused_ce",
            "provider": provider,
            "metric": "speed",
            "p50": p50,
            "config": {"N": n, "H": 2304, "V": 256000, "dtype": "bfloat16", "head": head},
        }

    rows = [
        row("leantrain", 8192, "frozen", 33.7),
        row("trl_fused", 8192, "frozen", 47.7),
        row("stock", 8192, "frozen", 61.0),
        row("liger", 8192, "frozen", 101.0),  # a peer: not a path's stock
        row("trl_fused", 8192, "trainable", 66.6),  # no leantrain cell: dropped
        {"provider": "leantrain", "metric": "memory", "p50": 1.0, "config": {}},
    ]
    cells = measured_from_rows(rows)
    assert sorted(cells) == sorted(
        [
            Measured("trl_fused", "frozen", 8192, 2304, 256000, "bfloat16", 47.7, 33.7),
            Measured("full_logits", "frozen", 8192, 2304, 256000, "bfloat16", 61.0, 33.7),
        ]
    )
    source = emit_rule(cells, "NVIDIA H100 80GB HBM3, 2026-11-26, fused_ce.json at abc1234")
    namespace = {"Measured": Measured}
    exec(source, namespace)
    assert namespace["SOURCE"].startswith("NVIDIA H100")
    assert sorted(namespace["MEASURED"]) == sorted(cells)


def test_unknown_path_or_head_raises():
    with pytest.raises(ValueError, match="unknown path"):
        choose("nll", "frozen", 1, 1, "float32", ())


def test_the_module_table_is_well_formed():
    for m in dispatch.MEASURED:
        assert m.path in dispatch.PATHS and m.head in dispatch.HEADS and m.stock_ms > 0 and m.leantrain_ms > 0


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
