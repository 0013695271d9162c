"""What a profiled window of training steps did, read from torch.profiler's Chrome trace: the GPU's kernels, copies
and idle time, per stream; the host's CUDA calls (its waits on the GPU among them) and its ops. Two windows side by
side (``compare_text``) say where one variant's extra step time goes: more GPU work, copies that did not overlap a
kernel, or host work (the GPU idle, waiting to be fed).

The trace's events: ``cat`` ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` on the device (``tid`` the stream),
``cuda_runtime`` / ``cuda_driver`` calls and ``cpu_op`` ops on the host; ``ts`` and ``dur`` in microseconds."""

from __future__ import annotations

from collections import Counter
from typing import Any

from _harness import markdown_table


# The calls where the host waits for the GPU to finish queued work.
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
TOP = 12  # the host calls and ops listed
NAME_WIDTH = 70


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(span: tuple[float, float], cover: list[tuple[float, float]]) -> float:
    """The part of ``span`` inside the (merged) ``cover``."""
    start, end = span
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in cover if a < end and b > start)


def summarize(trace: dict[str, Any]) -> dict[str, Any]:
    """The window's totals in ms: ``kernel_busy`` (some kernel running), ``gpu_busy`` (a kernel, copy or memset),
    ``span`` (first device event's start to the last one's end), ``idle`` (span - gpu_busy); per copy kind its count,
    ms, ms with a kernel beside it and the streams it ran on; the host's CUDA calls and ops by total ms (name: [ms,
    calls]), and ``host_waits`` (the calls of ``WAITS``)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    spans = lambda es: [(e["ts"], e["ts"] + e["dur"]) for e in es]  # noqa: E731
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = union(spans([e for e in device if e["cat"] == "kernel"]))
    busy = union(spans(device))
    out: dict[str, Any] = {
        "kernel_busy": sum(b - a for a, b in kernels) / 1e3,
        "gpu_busy": sum(b - a for a, b in busy) / 1e3,
        "span": (busy[-1][1] - busy[0][0]) / 1e3 if busy else 0.0,
        "kernel_streams": sorted({str(e.get("tid")) for e in device if e["cat"] == "kernel"}),
    }
    out["idle"] = out["span"] - out["gpu_busy"]
    copies: dict[str, dict[str, Any]] = {}
    for e in (e for e in device if e["cat"] == "gpu_memcpy"):
        kind = copies.setdefault(e["name"], {"count": 0, "ms": 0.0, "beside_kernel_ms": 0.0, "streams": []})
        kind["count"] += 1
        kind["ms"] += e["dur"] / 1e3
        kind["beside_kernel_ms"] += covered((e["ts"], e["ts"] + e["dur"]), kernels) / 1e3
        if str(e.get("tid")) not in kind["streams"]:
            kind["streams"].append(str(e.get("tid")))
    out["copies"] = copies
    out["host_calls"] = totals(e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    out["host_ops"] = totals(e for e in events if e.get("cat") == "cpu_op")
    waits = [v for k, v in out["host_calls"].items() if k in WAITS]
    out["host_waits"] = [sum(w[0] for w in waits), sum(w[1] for w in waits)]
    return out


def totals(events: Any) -> dict[str, list[float]]:
    """name: [total ms, calls], highest total first (every name kept: a difference needs both sides)."""
    ms: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in events:
        ms[e["name"]] += e["dur"] / 1e3
        calls[e["name"]] += 1
    return {name: [round(t, 3), calls[name]] for name, t in ms.most_common()}


GPU_ROWS = (
    ("span", "GPU span ms"),
    ("kernel_busy", "kernels ms"),
    ("gpu_busy", "kernels, copies or memsets ms"),
    ("idle", "idle ms (waiting on the host)"),
)
NO_COPY = {"count": 0, "ms": 0.0, "beside_kernel_ms": 0.0}


def compare_text(names: tuple[str, str], windows: tuple[dict[str, Any], dict[str, Any]], steps: int) -> str:
    """The two windows side by side, per step: the GPU's totals, each copy kind, the host's waits, and the host calls
    and ops whose total differs most between them."""
    a, b = windows
    head = ["", names[0], names[1], f"{names[1]} - {names[0]}"]
    rows = [[label, f"{a[key] / steps:.2f}", f"{b[key] / steps:.2f}", f"{(b[key] - a[key]) / steps:+.2f}"]
            for key, label in GPU_ROWS]  # fmt: skip
    for name in sorted(set(a["copies"]) | set(b["copies"])):
        ca, cb = (w["copies"].get(name, NO_COPY) for w in windows)
        rows.append([f"{name}: count / ms / ms beside a kernel", copy_cell(ca, steps), copy_cell(cb, steps),
                     f"{(cb['ms'] - ca['ms']) / steps:+.2f} ms"])  # fmt: skip
    waits = (a["host_waits"], b["host_waits"])
    rows.append(["host waits on the GPU: ms / calls", pair_cell(waits[0], steps, 2), pair_cell(waits[1], steps, 2),
                 f"{(waits[1][0] - waits[0][0]) / steps:+.2f} ms"])  # fmt: skip
    text = f"Per step, over {steps} steps of each:\n\n" + markdown_table(head, rows)
    for key, title in (("host_calls", "CUDA calls"), ("host_ops", "ops (inclusive time)")):
        lines = [[name[:NAME_WIDTH], pair_cell(x, steps, 3), pair_cell(y, steps, 3), f"{(y[0] - x[0]) / steps:+.3f}"]
                 for name, x, y in differences(a[key], b[key])[:TOP]]  # fmt: skip
        text += f"\n\nThe host's {title} that differ most, ms / calls a step:\n\n" + markdown_table(head, lines)
    return text + "\n"


def copy_cell(copy: dict[str, Any], steps: int) -> str:
    return f"{copy['count'] / steps:g} / {copy['ms'] / steps:.2f} / {copy['beside_kernel_ms'] / steps:.2f}"


def pair_cell(ms_calls: list[float], steps: int, digits: int) -> str:
    return f"{ms_calls[0] / steps:.{digits}f} / {ms_calls[1] / steps:g}"


def differences(a: dict[str, list[float]], b: dict[str, list[float]]) -> list[tuple[str, list[float], list[float]]]:
    """Every name of either side with both sides' [ms, calls], largest absolute ms difference first."""
    zero = [0.0, 0]
    rows = [(name, a.get(name, zero), b.get(name, zero)) for name in set(a) | set(b)]
    return sorted(rows, key=lambda r: (-abs(r[2][0] - r[1][0]), r[0]))
