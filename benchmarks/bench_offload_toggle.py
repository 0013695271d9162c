"""The offloaded checkpoints' step cost a step apart: one trainer patched once with the offload, its hooks paused on
one step of each pair (stock checkpointing) and not on the other, the order within each pair drawn by a seeded coin.

``bench_step_ab.py`` alternates segments of several steps, unpatching and patching between them; the shared GPU
machine's host moves step times by several percent over a segment's seconds, which left the offload's cost (a few
percent at most) inside the spread of its runs. Here the two variants run a step apart on the same trainer, the
same compiled layers and the same host state: each pair's ratio cancels the drift. With a fixed-length case every
step has the same shapes, so each pair compares like with like; with varying lengths a pair's two steps train
different batches, and the ratio of the summed times over many pairs (the coin decides which variant gets which
batch) is the estimate.

Rows, one a variant: median step ms (p20-p80) and the highest of its steps' peaks (allocated GiB, weights included,
reset at each step's start); on the offload's row the median of the pairs' ratios (paused over offloaded: above 1
the offload is faster) with a bootstrap 90% interval, their geometric mean and the ratio of the summed times.
Warm-up steps (both variants, alternating: the first compiles) and pairs where either step compiled a graph are
dropped. Writes ``offload_toggle.json`` / ``.md`` / ``.png`` (each pair's ratio in run order, the median and the
3% line) to ``--out``, ``$BENCH_RESULTS`` or ``benchmarks/results``:

    python benchmarks/bench_offload_toggle.py --case llama-3.2-1b-qlora --opt compile_layers=True --pairs 100  # CUDA
    python benchmarks/bench_offload_toggle.py --smoke                                                         # CPU
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import bench_step_ab as ab
import bench_vs_unsloth as vs
import torch
from _harness import Row, markdown_table, write_results
from recipes.runner import checkpointing
from step_ab_pool import bootstrap_median
from transformers import TrainerCallback

import leantrain
from leantrain.offload_checkpoints import hooks, stats


NAME = "offload_toggle"
COST_LINE = 0.97  # the ratio a step cost of 3% gives
VARIANTS = ("paused", "offload")


class Toggle(TrainerCallback):
    """Pauses the offload's hooks on the steps ``plan`` marks True, before the step starts; each step's peak
    allocated memory (CUDA) on ``peaks``, its packed inputs on ``packed``."""

    def __init__(self, trainer: Any, plan: list[bool], cuda: bool) -> None:
        self.trainer, self.plan, self.cuda = trainer, plan, cuda
        self.peaks: list[float] = []
        self.packed: list[int] = []
        self._packed_before = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hooks(self.trainer).paused = self.plan[state.global_step]
        self._packed_before = stats(self.trainer).packed
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.peaks.append(torch.cuda.max_memory_allocated() / 2**30 if self.cuda else math.nan)
        self.packed.append(stats(self.trainer).packed - self._packed_before)


def plan_steps(warmup: int, pairs: int, seed: int) -> list[bool]:
    """Per step, whether the hooks are paused: the warm-up alternating (each variant's first steps compile), then
    each pair in a coin's order."""
    coin = random.Random(seed)
    plan = [k % 2 == 1 for k in range(warmup)]
    for _ in range(pairs):
        first = coin.random() < 0.5
        plan += [first, not first]
    return plan


def pair_ratios(plan: list[bool], ms: list[float], compiled: list[bool], warmup: int) -> list[float]:
    """Each kept pair's paused time over its offloaded time (a pair where either step compiled is dropped)."""
    ratios = []
    for k in range(warmup, len(ms) - 1, 2):
        if compiled[k] or compiled[k + 1]:
            continue
        paused, offload = (ms[k], ms[k + 1]) if plan[k] else (ms[k + 1], ms[k])
        ratios.append(paused / offload)
    return ratios


def run(args: argparse.Namespace) -> list[Row]:
    cuda = not args.smoke
    case = vs.cases(args.smoke)[args.case]
    options = {"offload_checkpoints": True, **ab.parse_opts(args.opt)}
    if options.get("compile_layers") is True:
        options.setdefault("compile_layers_background", False)  # compiled in the process: the steps, not a child
    plan = plan_steps(args.warmup, args.pairs, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        vs.prepare(case, Path(tmp) / "model", cuda)
        trainer, _ = vs.hf_trainer(case, "stock", Path(tmp) / "model", str(Path(tmp) / "run"), cuda)
        if not cuda:  # the cases checkpoint on CUDA only; the offload has nothing to move without it
            for name, on in checkpointing(True).items():
                setattr(trainer.args, name, on)
        report = leantrain.patch_trainer(trainer, **options)
        print(report, flush=True)
        if hooks(trainer) is None:
            raise SystemExit(f"offload_checkpoints was not applied: {report['offload_checkpoints']}")
        toggle, clock = Toggle(trainer, plan, cuda), ab.StepTimes(cuda)
        trainer.add_callback(toggle)  # before the clock: the switch is not timed
        trainer.add_callback(clock)
        trainer.args.max_steps = len(plan)
        trainer.train()
    return rows_of(args, case.name, options, plan, clock, toggle)


def rows_of(
    args: argparse.Namespace, case: str, options: dict[str, Any], plan: list[bool], clock: Any, toggle: Toggle
) -> list[Row]:
    ratios = pair_ratios(plan, clock.ms, clock.compiled, args.warmup)
    kept = [k for k in range(args.warmup, len(clock.ms)) if not clock.compiled[k]]
    rows = []
    for variant in VARIANTS:
        mine = [k for k in kept if plan[k] == (variant == "paused")]
        times = sorted(clock.ms[k] for k in mine)
        config = {"pairs": args.pairs, "pairs_kept": len(ratios), "warmup": args.warmup, "seed": args.seed,
                  "patch_trainer": {k: repr(v) for k, v in options.items()}, "steps_kept": len(mine),
                  "peak_gib": max((toggle.peaks[k] for k in mine), default=math.nan),
                  "packed_per_step": statistics.median(toggle.packed[k] for k in mine) if mine else 0,
                  "ms": [round(clock.ms[k], 2) for k in mine]}  # fmt: skip
        if variant == "offload" and ratios:
            paused_sum = sum(clock.ms[k] for k in kept if plan[k])
            config.update(pair_ratios=[round(r, 4) for r in ratios], pair_median=statistics.median(ratios),
                          pair_interval=bootstrap_median(ratios), summed_ratio=paused_sum / sum(times),
                          geometric_mean=math.exp(statistics.fmean(math.log(r) for r in ratios)))  # fmt: skip
        rows.append(Row(NAME, variant, "step", "speed", "ms", "case", case, statistics.median(times),
                        percentile(times, 0.2), percentile(times, 0.8), config))  # fmt: skip
    return rows


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def table(rows: list[Row]) -> str:
    paused, offload = rows
    c = offload.config
    lines = [[r.x_value, r.provider, f"{r.p50:.1f} ({r.p20:.1f}-{r.p80:.1f})", r.config["steps_kept"],
              f"{r.config['packed_per_step']:g}", f"{r.config['peak_gib']:.2f}"] for r in rows]  # fmt: skip
    text = markdown_table(["case", "hooks", "step ms (p20-p80)", "steps", "inputs moved a step", "peak GiB"], lines)
    if "pair_median" in c:
        low, high = c["pair_interval"]
        verdict = "within" if c["pair_median"] >= COST_LINE else "not within"
        text += (
            f"\n\nOver {c['pairs_kept']} pairs (of {c['pairs']}): the median of the pairs' ratios (paused over "
            f"offloaded; above 1 the offload is faster) **{c['pair_median']:.3f}x** (bootstrap 90% interval "
            f"{low:.3f}-{high:.3f}), geometric mean {c['geometric_mean']:.3f}x, summed times "
            f"{c['summed_ratio']:.3f}x: {verdict} 3% of the step at the median."
        )
    options = ", ".join(f"{k}={v}" for k, v in c["patch_trainer"].items())
    return text + (
        f"\n\nOne trainer, `patch_trainer({options})`, the offload's hooks paused (stock checkpointing) on one step "
        f"of each pair, the order drawn by a seeded coin (seed {c['seed']}); {c['warmup']} warm-up steps and the "
        "pairs where a step compiled a graph dropped; step times CUDA-synchronized at each step's start and end.\n"
    )


def plot(path: Path, row: Row) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = row.config.get("pair_ratios", [])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(range(1, len(ratios) + 1), ratios, ".", label="each pair: paused / offloaded step")
    if ratios:
        ax.axhline(row.config["pair_median"], color="C1", label=f"median {row.config['pair_median']:.3f}x")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(COST_LINE, color="C3", ls="--", lw=0.8, label="a 3% step cost")
    ax.set_xlabel("pair, in run order")
    ax.set_ylabel("ratio (above 1: the offload faster)")
    ax.set_title(f"{row.x_value}: the offload a step apart")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="", help="one of bench_vs_unsloth.py's cases (default llama-3.2-1b)")
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=6, help="steps before the pairs (even: both variants warm up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--opt", action="append", default=[], help="patch_trainer name=value (compile_layers=True)")
    parser.add_argument("--smoke", action="store_true", help="a tiny case on the CPU")
    parser.add_argument("--out", default="", help="results directory (default $BENCH_RESULTS or benchmarks/results)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.case, args.pairs, args.warmup = args.case or "tiny-llama", min(args.pairs, 4), min(args.warmup, 2)
        torch.set_num_threads(2)
    args.case = args.case or "llama-3.2-1b"
    known = vs.cases(args.smoke)
    if args.case not in known:
        raise SystemExit(f"unknown case {args.case!r}: {list(known)}")
    if known[args.case].kind == "moe":
        raise SystemExit(f"{args.case}: a MoE case builds 4-bit experts only leantrain trains; use a dense case")
    if args.pairs < 1 or args.warmup < 0 or args.warmup % 2:
        raise SystemExit("--pairs must be positive and --warmup even and not negative")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    rows = run(args)
    out = write_results(NAME, rows, table(rows), Path(args.out) if args.out else None)
    plot(out / f"{NAME}.png", rows[1])
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
