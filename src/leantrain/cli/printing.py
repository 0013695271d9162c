"""The comparison's tables and lines as ``leantrain compare`` and ``leantrain demo`` print them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._measure import Measurement
from .verdict import MODES, ORDER, cuts_by_mode, median, tokens_per_s


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or not math.isfinite(value) else format(value, spec)


def _loss(value: float | None) -> str:
    """Six decimals, or three significant digits for a loss near 0 (GRPO's)."""
    return _fmt(value, ".6f" if value is None or not math.isfinite(value) or abs(value) >= 1e-3 else ".3e")


def _cpu(run: Measurement, cut: int) -> float | None:
    timed = run.step_cpu_ms[cut:]
    return median(timed) if timed else None


def _load(run: Measurement) -> float | None:
    loads = [x for x in run.host_load if x is not None]
    return max(loads) if loads else None


def report_text(runs: Sequence[Measurement]) -> str:
    from ..report import PatchOutcome, PatchReport, Status

    lean = next(r for r, o in zip(runs, ORDER) if o == "leantrain")
    if lean.report is None:
        return "(no report: the trainer was not patched)"
    data = lean.report
    outcomes = tuple(
        PatchOutcome(
            o["name"], Status(o["status"]), o["source"], tuple(o["reasons"]), tuple(o["targets"]), o.get("detail", "")
        )
        for o in data["outcomes"]
    )
    return str(PatchReport(data["trainer_kind"], outcomes, tuple(data.get("notes", ()))))


def table(runs: Sequence[Measurement], result: dict[str, Any], extra: Sequence[tuple[str, str, str]] = ()) -> str:
    """Side by side: where each run's timing starts, step time, peak memory, tokens/s, losses (and ``extra`` rows),
    then the ratio's spread. Every timed figure is over each run's own steps after its cut (``result["steady"]``)."""
    by_mode = {m: [r for r, o in zip(runs, ORDER) if o == m] for m in MODES}
    cuts = cuts_by_mode(result)
    speed = result["speed"]
    kind = runs[0].peak_kind or "peak memory"

    def per_run(values: Sequence[float | None], spec: str) -> str:
        return " / ".join(_fmt(v, spec) for v in values)

    rows = [
        ("", "stock", "leantrain"),
        ("untimed start of each run (steps)", *(" / ".join(str(c) for c in cuts[m]) for m in MODES)),
        ("step time, median (ms)", *(_fmt(speed[m]["median_ms"], ".1f") for m in MODES)),
        ("step time, p20-p80 (ms)", *(f"{speed[m]['p20_ms']:.1f}-{speed[m]['p80_ms']:.1f}" for m in MODES)),
        ("median of each run (ms)", *(per_run(speed[m]["run_medians_ms"], ".1f") for m in MODES)),
        ("first step of each run (ms)", *(per_run(result["first_step"][f"{m}_ms"], ".1f") for m in MODES)),
        (
            "process CPU time, median (ms)",
            *(per_run([_cpu(r, c) for r, c in zip(by_mode[m], cuts[m])], ".1f") for m in MODES),
        ),
        ("host load average, max", *(per_run([_load(r) for r in by_mode[m]], ".1f") for m in MODES)),
        (f"{kind} (MiB)", *(" / ".join(_mib(r.peak_bytes) for r in by_mode[m]) for m in MODES)),
        ("tokens/s", *(_fmt(tokens_per_s(by_mode[m], cuts[m]), ",.0f") for m in MODES)),
        (
            "loss, first / last step",
            *(f"{_loss(by_mode[m][0].losses[0])} / {_loss(by_mode[m][0].losses[-1])}" for m in MODES),
        ),
        *extra,
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    band = speed["ratio_p20_p80"]
    if band:
        lines.append(
            f"stock / leantrain step time: {speed['ratio']:.2f}x (the ratio of the run medians), "
            f"{band[0]:.2f}-{band[1]:.2f}x across the two p20-p80 bands"
        )
    return "\n".join(lines)


def loss_table(runs: Sequence[Measurement], result: dict[str, Any]) -> str:
    stock = next(r for r, o in zip(runs, ORDER) if o == "stock")
    lean = next(r for r, o in zip(runs, ORDER) if o == "leantrain")
    losses = result["losses"]
    rows = [("step", "stock", "leantrain", "max |diff|", "bound", "")]
    for k, (diff, bound) in enumerate(zip(losses["diff"], losses["bound"])):
        mark = "" if diff is None or bound is None or diff <= bound else "over"
        rows.append(
            (
                str(stock.steps[k] if k < len(stock.steps) else k + 1),
                _loss(stock.losses[k]),
                _loss(lean.losses[k]),
                _fmt(diff, ".2e"),
                _fmt(bound, ".2e"),
                mark,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def metric_lines(result: dict[str, Any]) -> list[str]:
    """One line per other checked metric: its largest difference and whether every step is within its bound."""
    lines = []
    for name, check in result["metrics"].items():
        diffs = [d for d in check["diff"] if d is not None]
        state = (
            "within its bound at every step" if check["same"] else f"over its bound from step {check['split_step']}"
        )
        lines.append(f"{name}: max |stock - leantrain| {max(diffs, default=0.0):.2e}, {state} (the same rule)")
    return lines
