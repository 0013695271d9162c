"""The vs-Unsloth benchmark's presentation beside its table: the trainer settings unlike stock's, the plot, the
whole run's time (a rounds table's column), and the run length the trainers were told (``bench_vs_unsloth.py``
writes them; rows are ``_harness.Row``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


WHOLE_RUN = "process start to last step s (steps)"


def whole_run(config: dict) -> str:
    """What a user waits for the run measured: process start (imports, load, compile) to the last step's end."""
    end, steps = config.get("to_last_step_s"), len(config.get("losses") or ())
    return f"{end:.1f} ({steps})" if end is not None else "–"


def unlike_stock(rows: list[Any], providers: list[str]) -> list[str]:
    """A table line: the trainer settings each provider ran with that differ from stock's on the same case."""
    speed = {(r.mode, r.provider): {**(r.config.get("args") or {}), "trainable parameters": r.config.get("trainable")}
             for r in rows if r.metric == "speed"}  # fmt: skip
    line = ["trainer settings unlike stock's"]
    for p in providers:
        mine = {case: a for (case, q), a in speed.items() if q == p and (case, "stock") in speed}
        where: dict[str, list[str]] = {}
        for case, a in mine.items():
            for k, v in a.items():
                if speed[(case, "stock")].get(k) != v:
                    where.setdefault(f"{k}={v}", []).append(case)
        text = [d if len(c) == len(mine) else f"{d} ({', '.join(c)})" for d, c in sorted(where.items())]
        recorded = any(len(a) > 1 for (case, q), a in speed.items() if q == p)
        line.append("; ".join(text) or ("none" if recorded else "not recorded"))
    return line


def plot(rows: list[Any], order: list[str], path: Path) -> None:
    """A panel per case (own scale): step ms per provider (the varlen case: ms per 1k real tokens), each bar named
    with its speed-up over stock."""
    from _harness import stacked_bar_panels

    panels: dict[str, dict[str, dict[str, float]]] = {}
    for case in order:
        varlen, values = case.endswith("varlen"), {}
        for r in rows:
            if r.mode != case or math.isnan(r.p50):
                continue
            if varlen and r.metric == "tokens per s" and r.p50 > 0:
                values[r.provider] = 1e6 / r.p50  # ms per 1000 real tokens
            elif not varlen and r.metric == "speed":
                values[r.provider] = r.p50
        base = values.get("stock")
        panels[case] = {f"{p} {base / v:.2f}x" if base else p: {"ms": v} for p, v in values.items()}
    title = "ms per step (varlen: per 1000 real tokens), bar label: speed-up over stock"
    stacked_bar_panels(path, title, panels, ["ms"], "ms")


def told(rows: list[Any], order: list[str]) -> str:
    """The run length each case's trainers were told (auto mode's compile decision rests on it): rows of older runs
    were told only their warm-up and timed steps."""
    steps: dict[str, list[str]] = {}
    for case in order:
        told = {(r.config.get("args") or {}).get("max_steps") for r in rows if r.mode == case and r.metric == "speed"}
        steps.setdefault(" / ".join(sorted(str(t) for t in told)), []).append(case)
    parts = [f"{n} steps ({', '.join(cases)})" for n, cases in steps.items()]
    return f"The run length the trainers were told: {'; '.join(parts)}.\n\n" if parts else ""
