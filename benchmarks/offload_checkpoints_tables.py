"""The rows, tables and plot of ``bench_offload_checkpoints.py`` from its workers' records: plain functions of
records and rows (``_harness.Row``), so that they are tested on CPU (tests/unit/test_bench_offload_checkpoints.py)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import statistics
import textwrap
from pathlib import Path
from typing import Any


SKIPS = ("skipped", "not installed")  # nothing to time: a second round or a further probe would say the same
NAME = "offload_checkpoints"
VARIANTS = ("stock", "hf_offload", "leantrain", "leantrain_offload", "unsloth")
TARGET_PCT = 3.0  # the offload's step cost against leantrain that auto mode may accept
LOSS_STEPS = 3  # "first losses": the steps compared with stock (later steps drift apart in bf16)
GIB = 2**30


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# -- rows ------------------------------------------------------------------------------------------------------------


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    """p20, median, p80 (the harness's deciles)."""
    qs = statistics.quantiles(samples, n=10) if len(samples) >= 2 else samples * 9
    return qs[1], statistics.median(samples), qs[7]


def combine(runs: list[dict]) -> dict[str, Any]:
    """One variant's runs of a case: pooled timed steps (p20/p50/p80), each run's median and first step, the highest
    peaks, the first finished run's losses; a run that failed is noted. No run finished: its status and reason."""
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return {"status": runs[-1]["status"], "reason": runs[-1].get("reason", "")}
    timed = [st["total_ms"] for r in ok for st in r["steps"] if not st.get("warmup")]
    p20, p50, p80 = quantiles(timed)
    return {
        "status": "ok", "p20": p20, "p50": p50, "p80": p80,
        "run_ms": [r["summary"]["p50"] if r["status"] == "ok" else None for r in runs],
        "first_step_s": [r.get("first_step_s") for r in runs],
        "peak_gib": max(r["peak_gib"] for r in ok), "reserved_gib": max(r["reserved_gib"] for r in ok),
        "peak_gib_runs": [r.get("peak_gib") for r in runs], "reserved_gib_runs": [r.get("reserved_gib") for r in runs],
        "base_gib": ok[0].get("base_gib"), "losses": ok[0]["losses"], "stats": ok[-1].get("stats"),
        "loss_noise": loss_gap(ok[0]["losses"], ok[-1]["losses"]) if len(ok) > 1 else None,
        "step_peaks_gib": ok[-1].get("step_peaks_gib"), "peak_trace": ok[-1].get("peak_trace"),
        "phase_marks": ok[-1].get("phase_marks"),
        "options": ok[0].get("options") or {},
        "steps_per_run": len(ok[-1]["steps"]),
        "tokens_per_s": statistics.median(r["summary"]["tokens_per_s"] for r in ok),
        "report": ok[0].get("report"), "args": ok[0].get("args"), "trainable": ok[0].get("trainable"),
        "checkpointing_kwargs": ok[0].get("checkpointing_kwargs"), "alloc_conf": ok[0].get("alloc_conf"),
        "failed_runs": [f"run {i + 1}: {r['status']}: {r.get('reason', '')[:200]}"
                        for i, r in enumerate(runs) if r["status"] != "ok"],
    }  # fmt: skip


def loss_gap(mine: list | None, theirs: list | None, steps: int | None = None) -> float | None:
    pairs = [(a, b) for a, b in zip((mine or [])[:steps], (theirs or [])[:steps]) if a is not None and b is not None]
    return max((abs(a - b) for a, b in pairs), default=None)


def common_fields(recs: list[dict], fallback: list[dict]) -> dict[str, Any]:
    """device, versions and date of a row from its records (the parent's own records, e.g. a timeout, have none)."""
    device = next((r["device"] for r in [*recs, *fallback] if r.get("device")), "unknown")
    versions = next((r["versions"] for r in [*recs, *fallback] if r.get("versions")), {})
    return {"device": device, "versions": versions, "date": max(r.get("date") or "" for r in recs) or now()}


def step_rows(runs: dict[tuple[str, str], list[dict]], known: dict[str, Any]) -> list[Any]:
    """Long-format rows of step mode: speed (ms), memory and reserved (GiB), first step (s) per (case, variant); a
    variant with no finished run is one status row."""
    from _harness import Row, git_commit

    commit = git_commit()
    everything = [r for recs in runs.values() for r in recs]
    combined = {key: combine(recs) for key, recs in runs.items()}
    rows = []
    for (case, variant), c in combined.items():
        common = {**common_fields(runs[(case, variant)], everything), "commit": commit}
        if c["status"] != "ok":
            config = {"status": c["status"], "reason": c["reason"]}
            rows.append(Row(NAME, variant, case, "status", "", "case", case, math.nan, config=config, **common))
            continue
        shape = known.get(case)
        config = {k: v for k, v in c.items() if k not in ("p20", "p50", "p80")}
        config |= {"case": dataclasses.asdict(shape) if shape else None, "order": "A B A B (same order every round)"}
        stock, lean = (combined.get((case, v), {}).get("losses") for v in ("stock", "leantrain"))
        config["loss_diff_vs_stock"] = loss_gap(c["losses"], stock, LOSS_STEPS)
        config["loss_diff_vs_leantrain"] = loss_gap(c["losses"], lean)
        first = [s for s in c["first_step_s"] if s is not None]
        runs_of = {k: {"status": "ok", "runs": c[k]} for k in ("peak_gib_runs", "reserved_gib_runs", "first_step_s")}
        metrics = [("speed", "ms", c["p50"], c["p20"], c["p80"], config),
                   ("memory", "GiB", c["peak_gib"], None, None, runs_of["peak_gib_runs"]),
                   ("reserved", "GiB", c["reserved_gib"], None, None, runs_of["reserved_gib_runs"]),
                   ("first step", "s", statistics.median(first) if first else math.nan, None, None,
                    runs_of["first_step_s"])]  # fmt: skip
        for metric, unit, p50, p20, p80, cfg in metrics:
            rows.append(Row(NAME, variant, case, metric, unit, "case", case, p50, p20, p80, config=cfg, **common))
    return rows


def longest_mode(case: str) -> str:
    return f"longest:{case}"


def longest_rows(results: dict[tuple[str, str], dict]) -> list[Any]:
    """Rows of --longest: the longest length (tokens; nan when nothing fits), the step time and peak memory at it."""
    from _harness import Row, git_commit

    commit = git_commit()
    everything = list(results.values())
    rows = []
    for (case, variant), rec in results.items():
        mode = longest_mode(case)
        common = {**common_fields([rec], everything), "commit": commit}
        x = ("cap_gib", rec["cap_gib"])
        if rec["status"] not in ("ok", "searching"):
            config = {"status": rec["status"], "reason": rec.get("reason", "")}
            rows.append(Row(NAME, variant, mode, "status", "", *x, math.nan, config=config, **common))
            continue
        config = {k: rec.get(k) for k in ("status", "low", "high", "step", "cap_gib", "probes", "parallel")}
        # the step time and peaks at the longest length: measured alone where the search ran side by side
        found = next((p for p in rec["probes"] if p["seq"] == rec["longest"] and p["status"] == "ok"), {})
        at = rec["alone"] if (rec.get("alone") or {}).get("status") == "ok" else found
        config["timed_alone"] = at is not found
        longest = math.nan if rec["longest"] is None else float(rec["longest"])
        rows.append(Row(NAME, variant, mode, "longest", "tokens", *x, longest, config=config, **common))
        for metric, unit, key in (("speed at longest", "ms", "step_ms"), ("memory at longest", "GiB", "peak_gib"),
                                  ("reserved at longest", "GiB", "reserved_gib")):  # fmt: skip
            value = at.get(key)
            rows.append(Row(NAME, variant, mode, metric, unit, *x, math.nan if value is None else float(value),
                            config={"status": "ok", "seq": rec["longest"]}, **common))  # fmt: skip
    return rows


def latest(rows: list[Any]) -> list[Any]:
    """The rows of each (case, provider) from its latest run, each row once (``_harness.latest_runs``)."""
    from _harness import latest_runs

    return latest_runs(rows)


# -- tables and plot -------------------------------------------------------------------------------------------------


def index(rows: list[Any]) -> dict[tuple[str, str, str], Any]:
    return {(r.mode, r.provider, r.metric): r for r in rows}


def modes(rows: list[Any], longest: bool) -> list[str]:
    """The cases in the rows in first-seen order: step cases, or the --longest ones."""
    found = [r.mode for r in rows if r.mode.startswith("longest:") == longest]
    return list(dict.fromkeys(found))


def clean(text: str, width: int = 160) -> str:
    """A reason on one table cell: a "|" would split the markdown row."""
    return " ".join(str(text).replace("|", "/").split())[:width]


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None where either is missing, nan or the base is not positive (a row that recorded 0)."""
    if value is None or base is None or math.isnan(value) or math.isnan(base) or base <= 0:
        return None
    return value / base


def pct(value: float, base: float) -> str:
    r = ratio(value, base)
    return "–" if r is None else f"{100 * (r - 1):+.1f}%"


def times(value: float | None, base: float | None) -> str:
    r = ratio(value, base)
    return "–" if r is None else f"{r:.2f}x"


def gib(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.2f}"


def step_table(rows: list[Any]) -> str:
    """One line per (case, variant): median step (p20-p80), each run's median, the change against leantrain, first
    step, peak allocated / reserved, the loss gap to stock, and notes (offload counters, failures)."""
    from _harness import markdown_table

    by = index(rows)
    lines = []
    for case in modes(rows, longest=False):
        base = by.get((case, "leantrain", "speed"))
        for variant in VARIANTS:
            status, speed = by.get((case, variant, "status")), by.get((case, variant, "speed"))
            if status is not None:
                note = f"{status.config['status']}: {clean(status.config.get('reason', ''))}"
                lines.append([case, variant, *["–"] * 7, note])
            elif speed is not None:
                lines.append([case, variant, *step_cells(by, case, variant, speed, base)])
    header = ["case", "variant", "step ms (p20–p80)", "run 1 / 2 ms", "vs leantrain", "first step s (runs)",
              "peak alloc GiB", "peak reserved GiB", f"loss diff vs stock (first {LOSS_STEPS})", "notes"]  # fmt: skip
    return markdown_table(header, lines)


def step_cells(by: dict, case: str, variant: str, speed: Any, base: Any) -> list[str]:
    c = speed.config
    runs = " / ".join("–" if v is None else f"{v:.1f}" for v in c.get("run_ms", []))
    first = " / ".join("–" if v is None else f"{v:.1f}" for v in c.get("first_step_s", []))
    diff = c.get("loss_diff_vs_stock")
    return [
        f"{speed.p50:.1f} ({speed.p20:.1f}–{speed.p80:.1f})", runs,
        pct(speed.p50, base.p50) if base is not None and variant != "leantrain" else "–", first,
        gib(by[(case, variant, "memory")].p50), gib(by[(case, variant, "reserved")].p50),
        "–" if diff is None else f"{diff:.3g}", clean("; ".join(notes(variant, c)), 400),
    ]  # fmt: skip


def notes(variant: str, c: dict) -> list[str]:
    """The offload's counters a step, its losses against leantrain's, and failed runs."""
    out = []
    stats, steps = c.get("stats"), c.get("steps_per_run") or 1
    if stats:
        out.append(f"{stats['packed'] / steps:.0f} inputs moved a step ({stats['packed_bytes'] / steps / GIB:.2f} "
                   f"GiB), host peak {stats['peak_bytes'] / GIB:.2f} GiB, kept {stats['kept']}, fetched ahead "
                   f"{stats['fetched_ahead']}, waited {stats['waited']}")  # fmt: skip
    gap = c.get("loss_diff_vs_leantrain")
    if variant == "leantrain_offload" and gap is not None:
        out.append("losses equal leantrain's" if gap == 0 else f"max loss diff vs leantrain {gap:.3g}")
    if c.get("options") and variant.startswith("leantrain"):
        out.append("patch_trainer options: " + ", ".join(f"{k}={v}" for k, v in c["options"].items()))
    if c.get("loss_noise"):  # two runs of one variant differ: the GPU's nondeterministic kernels set the floor
        out.append(f"its own two runs differ by {c['loss_noise']:.3g}")
    return out + list(c.get("failed_runs") or [])


def verdicts(rows: list[Any]) -> list[str]:
    """Per case: the offload's step cost against leantrain (the 3% target) and the memory it saves; transformers'
    offload against stock; leantrain's against Unsloth."""
    by = index(rows)
    out = []
    for case in modes(rows, longest=False):

        def get(variant: str, metric: str) -> Any:
            return by.get((case, variant, metric))

        parts = []
        lt, lo = get("leantrain", "speed"), get("leantrain_offload", "speed")
        if lt and lo and ratio(lo.p50, lt.p50) is not None:
            cost = 100 * (lo.p50 / lt.p50 - 1)
            met = "within" if cost <= TARGET_PCT else "over"
            alloc = saving(get("leantrain", "memory"), get("leantrain_offload", "memory"))
            reserved = saving(get("leantrain", "reserved"), get("leantrain_offload", "reserved"))
            parts.append(f"offload step cost vs leantrain {cost:+.1f}% ({met} the {TARGET_PCT:g}% target), "
                         f"{alloc} allocated, {reserved} reserved")  # fmt: skip
        st, hf = get("stock", "speed"), get("hf_offload", "speed")
        if st and hf:
            parts.append(f"transformers' offload vs stock {pct(hf.p50, st.p50)} step, "
                         f"{saving(get('stock', 'memory'), get('hf_offload', 'memory'))} allocated")  # fmt: skip
        un = get("unsloth", "speed")
        for mine in ("leantrain_offload", "leantrain") if un else ():
            if get(mine, "speed"):
                step = times(get(mine, "speed").p50, un.p50)
                memory = times(get(mine, "memory").p50, get("unsloth", "memory").p50)
                parts.append(f"{mine} vs Unsloth: step {step}, peak allocated {memory} Unsloth's")
        if parts:
            out.append(f"- **{case}**: " + "; ".join(parts) + ".")
    return out


def saving(before: Any, after: Any) -> str:
    if before is None or after is None:
        return "memory not recorded"
    saved = before.p50 - after.p50
    share = ratio(abs(saved), before.p50)
    return f"{abs(saved):.2f} GiB" + (f" ({100 * share:.0f}%)" if share else "") + (" less" if saved >= 0 else " more")


def longest_table(rows: list[Any]) -> str:
    """One line per (case, variant): the longest length under the cap (against stock's), the step time and peak
    memory at it, the probes run, and why nothing fits or where the search stopped."""
    from _harness import markdown_table

    by = index(rows)
    lines = []
    for mode in modes(rows, longest=True):
        case = mode.split(":", 1)[1]
        stock = by.get((mode, "stock", "longest"))
        for variant in VARIANTS:
            status, found = by.get((mode, variant, "status")), by.get((mode, variant, "longest"))
            label = f"{case} (cap {(status or found).x_value:g} GiB)" if (status or found) else case
            if status is not None:
                lines.append([label, variant, "–", "–", "–", "–", "–",
                              f"{status.config['status']}: {clean(status.config.get('reason', ''))}"])  # fmt: skip
            elif found is not None:
                lines.append([label, variant, *longest_cells(by, mode, variant, found, stock)])
    header = ["case", "variant", "longest tokens", "vs stock", "step ms at it", "peak alloc / reserved GiB at it",
              "probes", "notes"]  # fmt: skip
    return markdown_table(header, lines)


def longest_cells(by: dict, mode: str, variant: str, found: Any, stock: Any) -> list[str]:
    c = found.config
    probes = c.get("probes") or []
    length = "none" if math.isnan(found.p50) else f"{found.p50:.0f}"
    speed = by.get((mode, variant, "speed at longest"))
    memory = " / ".join(gib(by[(mode, variant, f"{m} at longest")].p50) for m in ("memory", "reserved"))
    note = []
    if c.get("status") == "searching":
        note.append("search cut off: the longest that fit so far")
    if not math.isnan(found.p50) and found.p50 >= c.get("high", math.inf):
        note.append(f"the search's ceiling ({c['high']}: --high or the model's position range) fits")
    # searched side by side (rows before "parallel" was recorded: more than one probe), and not timed alone after
    side_by_side = (c.get("parallel") or (2 if len(probes) > 1 else 1)) > 1
    if c.get("timed_alone") is False and not math.isnan(found.p50) and side_by_side:
        note.append("step timed during the search (its run alone did not finish)")
    if math.isnan(found.p50) and probes:
        note.append(f"{probes[0]['seq']} does not fit ({probes[0]['status']}: {clean(probes[0]['reason'], 200)})")
    step_ms = "–" if speed is None or math.isnan(speed.p50) else f"{speed.p50:.0f}"
    vs_stock = times(found.p50, stock.p50 if stock else None)
    return [length, vs_stock, step_ms, memory, str(len(probes)), "; ".join(note)]


HEADER = (
    "Each variant in its own process; every step-mode case twice, variants in the same order each time (A B A B: the "
    "GPU drifts). Step: median over both runs' timed steps (p20–p80), and each run's own median; vs leantrain: the "
    "change of the median against `patch_trainer(trainer, offload_checkpoints=False)`. Peak alloc / reserved: "
    "torch.cuda.max_memory_allocated / max_memory_reserved over training, weights included. Longest: bisection over "
    "multiples of the grid step, batch 1, 2 steps, under torch.cuda.set_per_process_memory_fraction(cap / total); an "
    "OOM, crash, timeout or leantrain fallback counts as not fitting; step ms at it is the second step. Full records "
    "(losses, counters, reports, probes) in the JSON."
)


def tables(rows: list[Any]) -> str:
    """The results' markdown: how it was measured, then the step-mode table and verdicts, the --longest table."""
    parts = [HEADER]
    if modes(rows, longest=False):
        parts += ["## Training step", step_table(rows), "\n".join(verdicts(rows))]
    if modes(rows, longest=True):
        parts += ["## Longest sequence under the memory cap", longest_table(rows)]
    return "\n\n".join(p for p in parts if p)


def plot(rows: list[Any], path: Path) -> None:
    """One row of panels per metric (step ms with its p20-p80 whisker, peak allocated GiB, longest tokens), a panel
    per case, one colour per variant in every panel, each bar labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wanted = {"speed": "step ms (median, p20-p80)", "memory": "peak allocated GiB", "longest": "longest tokens"}
    by = index(rows)
    grid = []  # (metric label, [(case title, {variant: row})])
    for metric, label in wanted.items():
        found = []
        for mode in modes(rows, longest=metric == "longest"):
            bars = {v: r for v in VARIANTS if (r := by.get((mode, v, metric))) is not None and not math.isnan(r.p50)}
            if bars:
                found.append((panel_title(mode, label.split(" (")[0], bars), bars))
        if found:
            grid.append((label, found))
    if not grid:
        return
    cols = max(len(found) for _, found in grid)
    fig, axes = plt.subplots(len(grid), cols, figsize=(3.6 * cols, 3.4 * len(grid)), squeeze=False)
    colors = dict(zip(VARIANTS, plt.get_cmap("tab10").colors, strict=False))
    for (label, found), ax_row in zip(grid, axes, strict=True):
        for ax in ax_row[len(found) :]:
            ax.axis("off")
        for ax, (title, bars) in zip(ax_row, found, strict=False):
            names = list(bars)
            values = [bars[v].p50 for v in names]
            low = [v - (bars[n].p20 if bars[n].p20 is not None else v) for n, v in zip(names, values, strict=True)]
            high = [(bars[n].p80 if bars[n].p80 is not None else v) - v for n, v in zip(names, values, strict=True)]
            drawn = ax.bar(range(len(names)), values, color=[colors[n] for n in names], yerr=[low, high], capsize=3)
            ax.bar_label(drawn, labels=[f"{v:.3g}" for v in values], fontsize=7, padding=2)
            ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
            ax.set_title(textwrap.fill(title, 40), fontsize=8)
            ax.margins(y=0.15)
        ax_row[0].set_ylabel(label, fontsize=8)
    fig.suptitle("offload_checkpoints: step time, peak GPU memory, longest sequence", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def panel_title(mode: str, part: str, found: dict[str, Any]) -> str:
    if not mode.startswith("longest:"):
        return f"{mode}: {part}"
    cap = next(r.x_value for r in found.values() if r is not None)
    return f"{mode.split(':', 1)[1]}: {part} under {cap:g} GiB"


# -- progress lines -------------------------------------------------------------------------------------------------


def step_line(rec: dict) -> str:
    head = f"[step] {rec['case']} / {rec['variant']} round {rec.get('round', 1)}"
    if rec["status"] != "ok":
        return f"{head}: {rec['status']} {rec.get('reason', '')[:300]} ({rec.get('wall_s', 0):.0f} s)"
    sm = rec["summary"]
    return (f"{head}: {sm['p50']:.1f} ms/step (p20 {sm['p20']:.1f}, p80 {sm['p80']:.1f}), peak "
            f"{rec['peak_gib']:.2f} GiB allocated / {rec['reserved_gib']:.2f} GiB reserved, first step "
            f"{rec['first_step_s']:.1f} s ({rec['wall_s']:.0f} s)")  # fmt: skip


def compact(probe: dict, seq: int) -> dict[str, Any]:
    """What a probe leaves in the record: its outcome, the second step's time, peak memory."""
    ok = probe["status"] == "ok"
    return {"seq": seq, "status": probe["status"], "reason": probe.get("reason", "")[:300],
            "step_ms": probe["summary"]["p50"] if ok else None, "first_step_s": probe.get("first_step_s"),
            "peak_gib": probe.get("peak_gib"), "reserved_gib": probe.get("reserved_gib"),
            "stats": probe.get("stats"), "wall_s": probe.get("wall_s")}  # fmt: skip


def probe_line(case: str, variant: str, p: dict) -> str:
    head = f"[longest] {case} / {variant}: {p['seq']} tokens"
    if p["status"] in SKIPS:
        return f"{head}: {p['status']} ({p['reason'][:200]}): no search"
    if p["status"] != "ok":
        return f"{head} does not fit ({p['status']}: {p['reason'][:200]}) ({p['wall_s']:.0f} s)"
    return (f"{head} fits: step {p['step_ms']:.0f} ms, peak {p['peak_gib']:.2f} GiB allocated / "
            f"{p['reserved_gib']:.2f} GiB reserved ({p['wall_s']:.0f} s)")  # fmt: skip


def longest_line(rec: dict) -> str:
    head = f"[longest] {rec['case']} / {rec['variant']}"
    if rec["status"] != "ok":
        return f"{head}: {rec['status']} {rec.get('reason', '')[:300]}"
    found = "nothing fits" if rec["longest"] is None else f"longest {rec['longest']} tokens"
    return f"{head}: {found} under {rec['cap_gib']:g} GiB ({len(rec['probes'])} probes)"
