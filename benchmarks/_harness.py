"""Shared benchmark utilities: CUDA-event timing (median of N with p20/p80), peak memory, a long-format result row
with device, versions, date and git commit, JSON/markdown writers and a bar-plot helper.

Every benchmark script compares stock vs leantrain (and a peer where one exists) in one run and writes
``benchmarks/results/<name>.json`` (rows) + ``<name>.md`` (table) + ``<name>.png`` (plot).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch


RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in (
        "transformers",
        "trl",
        "peft",
        "accelerate",
        "bitsandbytes",
        "cut-cross-entropy",
        "triton",
        "liger-kernel",
        "leantrain",
    ):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> str:
    if os.environ.get("BENCH_COMMIT"):  # set by gpu_run.sh from .bench_commit: the device copy's .git is stale
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except Exception:
        return os.environ.get("BENCH_COMMIT", "unknown")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Timing:
    p20: float
    p50: float
    p80: float
    samples: list[float] = field(repr=False)


def time_fn(fn: Callable[[int], Any], warmup: int = 3, reps: int = 20) -> Timing:
    """Milliseconds per call of ``fn(i)`` (``i`` lets the caller rotate inputs): CUDA events on GPU, perf_counter
    on CPU; warm-up calls first; returns p20/median/p80."""
    for i in range(warmup):
        fn(i)
    _sync()
    samples = []
    for i in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i)
            samples.append((time.perf_counter() - t0) * 1e3)
    qs = statistics.quantiles(samples, n=10) if len(samples) >= 2 else samples * 9
    return Timing(qs[1], statistics.median(samples), qs[7], samples)


def peak_memory(fn: Callable[[], Any]) -> float:
    """Peak allocated GiB above what was allocated before ``fn()`` (CUDA only; nan on CPU)."""
    if not torch.cuda.is_available():
        fn()
        return float("nan")
    _sync()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


@dataclass
class Row:
    benchmark: str
    provider: str  # stock / leantrain / peer name
    mode: str  # forward / full / step / ...
    metric: str  # speed / memory / quality
    unit: str
    x_name: str
    x_value: Any
    p50: float
    p20: float | None = None
    p80: float | None = None
    config: dict[str, Any] = field(default_factory=dict)
    device: str = field(default_factory=device_name)
    versions: dict[str, str] = field(default_factory=versions)
    date: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    commit: str = field(default_factory=git_commit)

    @classmethod
    def timing(cls, benchmark: str, provider: str, mode: str, x_name: str, x_value: Any, t: Timing, **config):
        return cls(benchmark, provider, mode, "speed", "ms", x_name, x_value, t.p50, t.p20, t.p80, config)


def write_results(name: str, rows: Sequence[Row], table: str, out_dir: Path | None = None) -> Path:
    """Write ``<name>.json`` (rows) and ``<name>.md`` (header with device/versions/date + the table)."""
    out_dir = Path(out_dir or os.environ.get("BENCH_RESULTS", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps([asdict(r) for r in rows], indent=1, default=str))
    head = rows[0] if rows else Row(name, "", "", "", "", "", "", 0.0)
    vers = ", ".join(f"{k} {v}" for k, v in head.versions.items())
    md = (
        f"# {name}\n\nDevice: {head.device}. Date: {head.date}. Commit: {head.commit}.\nVersions: {vers}.\n\n{table}\n"
    )
    (out_dir / f"{name}.md").write_text(md)
    return out_dir


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def bar_plot(path: Path, title: str, groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str) -> None:
    """Grouped bars: one group per x value, one bar per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def previous_rows(name: str, out_dir: Path, smoke: bool) -> list[Row]:
    """The rows a run of benchmark ``name`` adds to: those already in ``out_dir``, else the committed ones in
    ``benchmarks/results/``; a smoke run never joins the measured rows (tiny CPU shapes are not results)."""
    for path in (out_dir / f"{name}.json",) if smoke else (out_dir / f"{name}.json", RESULTS / f"{name}.json"):
        if path.exists():
            return read_rows(path)
    return []


def latest_runs(rows: Sequence[Row]) -> list[Row]:
    """The rows of each (mode, provider) from its latest run (the rows of one run share its date), each row once (a
    run found in several merged files, as a device call's output holds the committed rows it started from)."""
    newest: dict[tuple[str, str], str] = {}
    for r in rows:
        newest[(r.mode, r.provider)] = max(newest.get((r.mode, r.provider), ""), r.date)
    seen: set[str] = set()
    kept = []
    for r in rows:
        key = json.dumps(asdict(r), sort_keys=True, default=str)
        if r.date == newest[(r.mode, r.provider)] and key not in seen:
            seen.add(key)
            kept.append(r)
    return kept


def read_rows(path: Path) -> list[Row]:
    """Rows of a ``<name>.json`` written by :func:`write_results` (empty when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [Row(**entry) for entry in json.loads(path.read_text())]


def stacked_bar_panels(
    path: Path,
    title: str,
    panels: dict[str, dict[str, dict[str, float]]],
    parts: Sequence[str],
    ylabel: str,
) -> None:
    """One figure, one panel per group (own y scale): ``panels[group][bar][part] = value``, bars side by side with
    their parts stacked in ``parts`` order (one colour per part, shared legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g, bars in panels.items() if bars]
    widths = {g: max(3, len(panels[g])) for g in groups}
    lines = _wrap(groups, widths, ROW_BARS)
    span = max((sum(widths[g] for g in line) for line in lines), default=2)
    fig = plt.figure(figsize=(max(6, 0.9 * span + 1.5), 4.6 * max(1, len(lines)) + 0.4))
    subfigs = fig.subfigures(max(1, len(lines)), 1, squeeze=False)[:, 0]
    colors = plt.get_cmap("tab10").colors
    first = None
    for subfig, line in zip(subfigs, lines):
        # a row shorter than the widest keeps the same width per bar: pad it with an empty slot
        ratios = [widths[g] for g in line] + ([span - sum(widths[g] for g in line)] if len(lines) > 1 else [])
        ratios = [r for r in ratios if r > 0]
        axes = subfig.subplots(1, len(ratios), squeeze=False, width_ratios=ratios)[0]
        for ax in axes[len(line) :]:
            ax.axis("off")
        for ax, group in zip(axes, line):
            _stack(ax, panels[group], parts, colors)
            ax.set_title(textwrap.fill(group, 7 * widths[group]), fontsize=9)
        first = first if first is not None else axes[0]
    if first is not None:
        first.set_ylabel(ylabel)
        handles, labels = first.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper right", fontsize=7, ncol=len(parts))
    fig.suptitle(title, fontsize=10, x=0.01, y=1.02, ha="left")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# Bars per row of panels before the next panel starts a new row: a figure stays readable at page width.
ROW_BARS = 24


def _wrap(groups: Sequence[str], widths: dict[str, int], limit: int) -> list[list[str]]:
    lines: list[list[str]] = []
    for g in groups:
        if lines and sum(widths[x] for x in lines[-1]) + widths[g] <= limit:
            lines[-1].append(g)
        else:
            lines.append([g])
    return lines


def _stack(ax: Any, bars: dict[str, dict[str, float]], parts: Sequence[str], colors: Sequence[Any]) -> None:
    bottom = [0.0] * len(bars)
    for k, part in enumerate(parts):
        values = [bars[b].get(part, 0.0) for b in bars]
        ax.bar(range(len(bars)), values, 0.7, bottom=bottom, color=colors[k % len(colors)], label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(bars)), list(bars), rotation=60, ha="right", fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
