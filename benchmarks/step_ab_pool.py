"""Several ``bench_step_ab.py`` runs of the same two variants, pooled: one run's six pairs cannot tell a cost of a
few percent from the shared host's spread (pair ratios of 0.77-1.58 within one run on an H200), several runs can.

For each run: its same-batch ratio (the median over its pairs of each pair's summed times on the same batches, as
``bench_step_ab`` reports it). Pooled over the runs: every pair's ratio (their median, a bootstrap interval of that
median over the pairs, their geometric mean), the ratio of the summed times of every matched step (the steps after
a segment's first where neither variant compiled and the tokens match), and that same ratio by the tokens a step
trained on (``--token-edges``: with varying lengths, which micro-batches a cost falls on). Above 1 the variant is
faster; ``--cost-line`` draws the ratio a cost target allows (0.97: 3% of the step).

Writes ``<name>.json`` (a row per run, a pooled row, a row per token range; device, versions, date and commit from
the runs' rows), ``<name>.md`` and ``<name>.png`` (each pair's ratio by run beside the pooled median, and the
token ranges) in ``--out`` (default ``$BENCH_RESULTS`` or ``benchmarks/results``):

    python benchmarks/step_ab_pool.py --name step_ab_varlen_offload_pooled --token-edges 2048,4096 \\
        run1/step_ab.json run2/step_ab.json run3/step_ab.json run4/step_ab.json
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from _harness import Row, markdown_table, read_rows, write_results


BOOTSTRAP_DRAWS = 10_000
SEED = 0  # the bootstrap's draws: the same files give the same interval


@dataclass(frozen=True)
class Run:
    path: Path
    base: Row
    variant: Row

    @property
    def pair_ratios(self) -> list[float]:
        return list(self.variant.config.get("same_batch_pair_speedups", []))


@dataclass(frozen=True)
class Matched:
    tokens: int
    base_ms: float
    variant_ms: float


def load_run(path: Path) -> Run:
    """The base and variant rows of one ``bench_step_ab`` JSON; stops with the reason when it is not one whose
    rows kept their steps (written before ``bench_step_ab`` recorded them, or not that benchmark's)."""
    rows = read_rows(path)
    if not rows:
        raise SystemExit(f"{path}: no rows (not a results JSON, or missing)")
    base = [r for r in rows if r.provider in ("base", "stock")]
    variant = [r for r in rows if r.provider == "leantrain"]
    if len(base) != 1 or len(variant) != 1:
        raise SystemExit(f"{path}: not one bench_step_ab run (a base or stock row and a leantrain row)")
    for row in (base[0], variant[0]):
        if "steps" not in row.config or "same_batch_pair_speedups" not in row.config:
            raise SystemExit(f"{path}: the {row.provider} row has no per-step record (bench_step_ab wrote none then)")
    return Run(path, base[0], variant[0])


def matched_steps(run: Run) -> list[Matched]:
    """The steps a pair's two segments trained on the same batch: after each segment's first, at the same position,
    neither compiling a graph, the same tokens (what ``bench_step_ab``'s same-batch ratio sums)."""
    out = []
    for a, b in zip(run.base.config["steps"], run.variant.config["steps"], strict=True):
        for i in range(1, min(len(a["ms"]), len(b["ms"]))):
            if a["compiled"][i] or b["compiled"][i] or a["tokens"][i] != b["tokens"][i]:
                continue
            out.append(Matched(a["tokens"][i], a["ms"][i], b["ms"][i]))
    return out


def summed_ratio(steps: list[Matched]) -> float:
    variant = sum(s.variant_ms for s in steps)
    return sum(s.base_ms for s in steps) / variant if variant else math.nan


def bootstrap_median(values: list[float], draws: int = BOOTSTRAP_DRAWS, seed: int = SEED) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of ``values`` resampled with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


def token_ranges(edges: list[int]) -> list[tuple[int, float, str]]:
    bounds = [0, *edges, math.inf]
    ranges = []
    for low, high in zip(bounds, bounds[1:]):
        label = (
            f"under {high:,}" if low == 0 else (f"{low:,} and more" if high == math.inf else f"{low:,}-{high - 1:,}")
        )
        ranges.append((low, high, label))
    return ranges


def by_tokens(steps: list[Matched], edges: list[int]) -> list[tuple[str, float, int]]:
    """(range, summed ratio, steps) for each token range that has steps."""
    out = []
    for low, high, label in token_ranges(edges):
        inside = [s for s in steps if low <= s.tokens < high]
        if inside:
            out.append((label, summed_ratio(inside), len(inside)))
    return out


def pooled_rows(name: str, runs: list[Run], edges: list[int]) -> list[Row]:
    head = runs[0].variant
    stamp = {"device": head.device, "versions": head.versions, "date": head.date, "commit": head.commit}
    rows = []
    for i, run in enumerate(runs, 1):
        steps = matched_steps(run)
        config = {
            "file": str(run.path),
            "case": run.variant.x_value,
            "pair_ratios": run.pair_ratios,
            "matched_steps": len(steps),
            "summed_ratio": summed_ratio(steps),
            "base_median_ms": run.base.p50,
            "variant_median_ms": run.variant.p50,
            "patch_trainer": run.variant.config.get("patch_trainer", {}),
            "base_patch_trainer": run.base.config.get("patch_trainer", {}),
        }
        rows.append(Row(name, "run", "step", "speedup", "x", "run", i, run.variant.config["same_batch_speedup"],
                        config=config, device=run.variant.device, versions=run.variant.versions,
                        date=run.variant.date, commit=run.variant.commit))  # fmt: skip
    pairs = [r for run in runs for r in run.pair_ratios]
    steps = [s for run in runs for s in matched_steps(run)]
    low, high = bootstrap_median(pairs)
    config = {
        "pairs": len(pairs),
        "geometric_mean": statistics.geometric_mean(pairs),
        "summed_ratio": summed_ratio(steps),
        "matched_steps": len(steps),
        "bootstrap": "5-95% of the median",
    }
    rows.append(Row(name, "pooled", "step", "speedup", "x", "runs", len(runs), statistics.median(pairs), low, high,
                    config, **stamp))  # fmt: skip
    for label, ratio, count in by_tokens(steps, edges):
        rows.append(Row(name, "tokens", "step", "speedup", "x", "tokens", label, ratio, config={"steps": count},
                        **stamp))  # fmt: skip
    return rows


def table(rows: list[Row], cost_line: float) -> str:
    runs = [r for r in rows if r.provider == "run"]
    pooled = next(r for r in rows if r.provider == "pooled")
    ranges = [r for r in rows if r.provider == "tokens"]
    per_run = markdown_table(
        ["run", "commit", "date", "base median ms", "variant median ms", "same batches, median of the pairs",
         "pair ratios", "summed over matched steps"],
        [[r.x_value, r.commit, r.date, f"{r.config['base_median_ms']:.1f}", f"{r.config['variant_median_ms']:.1f}",
          f"**{r.p50:.3f}x**", ", ".join(f"{x:.2f}" for x in r.config["pair_ratios"]),
          f"{r.config['summed_ratio']:.3f}x ({r.config['matched_steps']} steps)"] for r in runs],
    )  # fmt: skip
    c = pooled.config
    if pooled.p20 >= cost_line:
        met = f"The whole interval is within the cost line ({cost_line:.2f}x, {1 - cost_line:.0%} of the step)."
    elif pooled.p50 >= cost_line:
        met = (f"The pooled median is within the cost line ({cost_line:.2f}x, {1 - cost_line:.0%} of the step); the "
               f"interval's lower end is not: more pairs would narrow it.")  # fmt: skip
    else:
        met = f"The pooled median is not within the cost line ({cost_line:.2f}x, {1 - cost_line:.0%} of the step)."
    summary = (
        f"Pooled over {c['pairs']} pairs of {len(runs)} runs: median **{pooled.p50:.3f}x** (bootstrap 90% interval "
        f"{pooled.p20:.3f}-{pooled.p80:.3f}), geometric mean {c['geometric_mean']:.3f}x; summed over "
        f"{c['matched_steps']} matched steps {c['summed_ratio']:.3f}x. {met}"
    )
    by_range = markdown_table(
        ["tokens a step trained on", "summed ratio", "steps"],
        [[r.x_value, f"{r.p50:.3f}x", r.config["steps"]] for r in ranges],
    )
    first = runs[0].config
    compared = (
        f"Case `{first['case']}`: `patch_trainer({options_text(first['base_patch_trainer'])})` (base) against "
        f"`patch_trainer({options_text(first['patch_trainer'])})` (variant), each run one process alternating the two "
        "in pairs of segments (`bench_step_ab.py`)."
    )
    return f"{compared}\n\n{per_run}\n\n{summary}\n\n{by_range}\n\nAbove 1 the variant is faster. Files: " + ", ".join(
        f"`{r.config['file']}`" for r in runs
    )


def options_text(options: dict[str, str]) -> str:
    return ", ".join(f"{name}={value}" for name, value in options.items())


def plot(path: Path, rows: list[Row], cost_line: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r.provider == "run"]
    pooled = next(r for r in rows if r.provider == "pooled")
    ranges = [r for r in rows if r.provider == "tokens"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 2]})
    for r in runs:
        ratios = r.config["pair_ratios"]
        left.scatter([r.x_value] * len(ratios), ratios, color="tab:blue", alpha=0.6)
        left.scatter([r.x_value], [r.p50], color="black", marker="_", s=400)
    left.axhspan(pooled.p20, pooled.p80, color="tab:green", alpha=0.15, label="pooled median, 90% interval")
    left.axhline(pooled.p50, color="tab:green", label=f"pooled median {pooled.p50:.3f}x")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.axhline(cost_line, color="tab:red", linestyle="--", label=f"{1 - cost_line:.0%} cost")
    left.set_xticks([r.x_value for r in runs], [f"run {r.x_value}" for r in runs])
    left.set_ylabel("base time / variant time, same batches")
    left.set_title("each pair (dots) and each run's median (bars)")
    left.legend(fontsize=8)
    right.bar([r.x_value for r in ranges], [r.p50 for r in ranges], color="tab:blue")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.axhline(cost_line, color="tab:red", linestyle="--")
    right.set_ylim(min([cost_line, *[r.p50 for r in ranges]]) - 0.05, max([1.0, *[r.p50 for r in ranges]]) + 0.05)
    right.set_title("summed over matched steps, by tokens")
    right.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="bench_step_ab JSONs of the same two variants")
    parser.add_argument("--name", required=True, help="the results' name (<name>.json / .md / .png)")
    parser.add_argument("--token-edges", default="", help="comma-separated token counts that split the steps")
    parser.add_argument("--cost-line", type=float, default=0.97, help="the ratio a cost target allows (0.97: 3%%)")
    parser.add_argument("--out", default="", help="results directory (default $BENCH_RESULTS or benchmarks/results)")
    args = parser.parse_args(argv)
    try:
        edges = sorted(int(e) for e in args.token_edges.split(",") if e.strip())
    except ValueError:
        raise SystemExit(f"--token-edges: comma-separated token counts, not {args.token_edges!r}") from None
    if any(e <= 0 for e in edges) or not 0 < args.cost_line <= 1:
        raise SystemExit("--token-edges must be positive and --cost-line in (0, 1]")
    runs = [load_run(path) for path in args.files]
    options = {repr((r.base.config.get("patch_trainer"), r.variant.config.get("patch_trainer"))) for r in runs}
    cases = {r.variant.x_value for r in runs}
    if len(options) > 1 or len(cases) > 1:
        raise SystemExit("the runs compare different cases or options: pool runs of one comparison only")
    if not any(r.pair_ratios for r in runs):
        raise SystemExit("no pair of these runs matched a step on the same batch")
    rows = pooled_rows(args.name, runs, edges)
    out = write_results(args.name, rows, table(rows, args.cost_line), Path(args.out) if args.out else None)
    plot(out / f"{args.name}.png", rows, args.cost_line)
    print(f"{args.name}: {out}")
    return out


if __name__ == "__main__":
    main()
