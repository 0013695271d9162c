"""benchmarks/trace_summary.py on a hand-made Chrome trace: the GPU's kernel, busy, span and idle time, each copy
and the part of it a kernel ran beside, the host's waits, and the side-by-side text."""

from __future__ import annotations

import pytest
import trace_summary


def event(cat: str, name: str, ts: float, dur: float, tid: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


# Kernels on stream 7 at 0-100 and 150-250 us; a copy to the host on stream 45 at 50-200 (100 us of it beside a
# kernel), one back at 300-400 (none); a memset at 260-270; the host waits 30 us once and launches twice.
TRACE = {
    "traceEvents": [
        event("kernel", "gemm", 0, 100),
        event("kernel", "gemm", 150, 100),
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50, 150, tid=45),
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 300, 100, tid=45),
        event("gpu_memset", "Memset (Device)", 260, 10),
        event("cuda_runtime", "cudaStreamSynchronize", 10, 30, tid=1),
        event("cuda_runtime", "cudaLaunchKernel", 0, 5, tid=1),
        event("cuda_runtime", "cudaLaunchKernel", 140, 5, tid=1),
        event("cpu_op", "aten::mm", 0, 8, tid=1),
        {"ph": "i", "name": "an instant event, no duration", "ts": 5},
    ]
}


def test_the_gpu_totals_and_each_copy_beside_the_kernels():
    s = trace_summary.summarize(TRACE)
    assert s["kernel_busy"] == pytest.approx(0.2)
    assert s["gpu_busy"] == pytest.approx(0.36)  # 0-250, 260-270, 300-400
    assert s["span"] == pytest.approx(0.4) and s["idle"] == pytest.approx(0.04)
    assert s["kernel_streams"] == ["7"]
    d2h, h2d = s["copies"]["Memcpy DtoH (Device -> Pinned)"], s["copies"]["Memcpy HtoD (Pinned -> Device)"]
    assert (d2h["count"], d2h["ms"], d2h["beside_kernel_ms"], d2h["streams"]) == (1, 0.15, pytest.approx(0.1), ["45"])
    assert (h2d["ms"], h2d["beside_kernel_ms"]) == (0.1, 0.0)
    assert s["host_waits"] == [0.03, 1]
    assert s["host_calls"]["cudaLaunchKernel"] == [0.01, 2] and s["host_ops"] == {"aten::mm": [0.008, 1]}


def test_an_empty_window_summarizes_to_zeros():
    s = trace_summary.summarize({"traceEvents": []})
    assert (s["span"], s["kernel_busy"], s["idle"], s["copies"], s["host_waits"]) == (0.0, 0.0, 0.0, {}, [0, 0])


def test_side_by_side_per_step_with_the_largest_differences_first():
    base = trace_summary.summarize(TRACE)
    more = trace_summary.summarize({"traceEvents": [*TRACE["traceEvents"], event("cpu_op", "pack", 500, 40, tid=1)]})
    text = trace_summary.compare_text(("paused", "offload"), (base, more), steps=2)
    assert "| GPU span ms | 0.20 | 0.20 | +0.00 |" in text
    assert "| Memcpy DtoH (Device -> Pinned): count / ms / ms beside a kernel | 0.5 / 0.07 / 0.05 |" in text
    ops = text.split("ops (inclusive time)")[1]
    assert ops.index("pack") < ops.index("aten::mm")  # the op only one side has differs most
    assert "| pack | 0.000 / 0 | 0.020 / 0.5 | +0.020 |" in ops
