"""The offloaded checkpoints' step cost a step apart: one trainer patched once with the offload, its hooks paused on
one step of each pair (stock checkpointing) and not on the other, the order within each pair drawn by a seeded coin.

``bench_step_ab.py`` alternates segments of several steps, unpatching and patching between them; the shared GPU
machine's host moves step times by several percent over a segment's seconds, which left the offload's cost (a few
percent at most) inside the spread of its runs. Here the two variants run a step apart on the same trainer, the
same compiled layers and the same host state: each pair's ratio cancels the drift. Each batch is trained twice in a
row (``paired_batches``), so a pair's two steps train the same rows: with varying lengths too, each pair compares
like with like.

Rows, one a variant: median step ms (p20-p80) and the highest of its steps' peaks (allocated GiB, weights included,
reset at each step's start); on the offload's row the median of the pairs' ratios (paused over offloaded: above 1
the offload is faster) with a bootstrap 90% interval, their geometric mean and the ratio of the summed times.
Warm-up steps (both variants, alternating: the first compiles) and pairs where either step compiled a graph are
dropped. Writes ``offload_toggle.json`` / ``.md`` / ``.png`` (each pair's ratio in run order, the median and the
3% line) to ``--out``, ``$BENCH_RESULTS`` or ``benchmarks/results``; every ``PARTIAL_EVERY`` pairs the pairs done so
far are written there, marked partial (a run its time limit stops keeps them).

``--time-hooks`` times the host inside the offload's two hooks (``time.perf_counter`` around each pack and unpack)
and puts the median a step on the offload's row: how much of the step cost the hooks' own calls are, the rest being
what they cause elsewhere (the allocators' work at frees, the checkpoint's).

``--keep-inputs`` and ``--copy-bytes N`` (diagnostics) keep every input on the device while the hooks copy the
whole input, or only its first N bytes: the offload's calls and traffic without its frees, or its calls alone
(``KeptOnDevice``).

``--profile N`` adds, after the pairs, N paused steps then N offloaded ones, each window under torch.profiler, and
writes ``offload_toggle_profile.md`` / ``.json`` (``trace_summary.py``): per step, the GPU's kernel time, idle time
and copies (with the part of each copy a kernel ran beside), the host's waits on the GPU, and the host calls and ops
whose time differs most between the two: where the offload's step cost goes.

The cases log every step (``logging_steps=1``): each log reads the loss and the gradient norm, a wait for the GPU.
``--logging-steps 10`` (TRL's default) measures the step a run with fewer logs takes.

    python benchmarks/bench_offload_toggle.py --case llama-3.2-1b-qlora --opt compile_layers=True --pairs 100  # CUDA
    python benchmarks/bench_offload_toggle.py --case llama-3.2-1b --opt compile_layers=True --profile 3   # + where
    python benchmarks/bench_offload_toggle.py --smoke                                                         # CPU
    python benchmarks/bench_offload_toggle.py --summary benchmarks/results/offload_toggle_*_run*.json  # runs, one plot
    python benchmarks/bench_offload_toggle.py --tradeoff benchmarks/results/offload_toggle_*_{run,half}*.json \
        benchmarks/results/vs_unsloth_rounds_offload_*.json                  # peak against cost, Unsloth's peak
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_step_ab as ab
import bench_vs_unsloth as vs
import torch
import trace_summary
from _harness import Row, markdown_table, write_results
from recipes.runner import checkpointing
from step_ab_pool import bootstrap_median
from transformers import TrainerCallback

import leantrain
from leantrain.offload_checkpoints import hooks, stats
from leantrain.offload_checkpoints.measured import AUTO_MIN_TOKENS


NAME = "offload_toggle"
COST_LINE = 0.97  # the ratio a step cost of 3% gives
VARIANTS = ("paused", "offload")
PARTIAL_EVERY = 20  # pairs between two partial writes


class HookClock:
    """The host milliseconds spent inside ``offload``'s pack and unpack hooks, and their calls, summed since the start
    (the hooks ``HostOffload.context()`` enters, swapped for timed ones)."""

    def __init__(self, offload: Any) -> None:
        self.ms = {"pack": 0.0, "unpack": 0.0}
        self.calls = {"pack": 0, "unpack": 0}
        offload._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._timed("pack", offload.pack), self._timed("unpack", offload.unpack)
        )

    def _timed(self, name: str, hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def timed(value: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(value)
            finally:
                self.ms[name] += (time.perf_counter() - start) * 1e3
                self.calls[name] += 1

        return timed

    def totals(self) -> tuple[float, float, int, int]:
        return self.ms["pack"], self.ms["unpack"], self.calls["pack"], self.calls["unpack"]


class KeptOnDevice:
    """``--keep-inputs`` and ``--copy-bytes N``, diagnostics: every input stays on the device (the unpack hands it
    back) while the offload's hooks make every call they make, their copies moving the whole input (``nbytes`` 0) or
    its first ``nbytes``. The same calls in the same order and the same values; none of the device memory the offload
    frees (nor the allocator's work at those frees), and with ``nbytes`` none of the traffic through host memory
    either. Set beside the offload's own cost, the three runs tell whether the calls, the bytes or the frees cost."""

    def __init__(self, offload: Any, nbytes: int = 0) -> None:
        self.nbytes = nbytes
        self._pack, self._unpack = offload.pack, offload.unpack
        offload.pack, offload.unpack = self.pack, self.unpack  # what ``HookClock`` times, when made after this
        offload._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        size = tensor.numel() * tensor.element_size()
        if size == 0 or size <= self.nbytes or (tensor.is_leaf and tensor.requires_grad):
            return self._pack(tensor)  # what the hooks leave as it is, or move whole anyway
        copied = tensor.detach()
        if self.nbytes:
            copied = copied.reshape(-1).view(torch.uint8)[: self.nbytes]
        return self._pack(copied), tensor

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return self._unpack(packed)
        self._unpack(packed[0])  # the copy's way back, and the one started ahead for the next input
        return packed[1]


class GcClock:
    """Python's garbage collections (``gc.callbacks``): per generation, the milliseconds they took and their count,
    summed since the start. A collection stops the host wherever it falls (most often inside the compiled layers'
    Python wrappers, where most objects are made); the offload's hooks make objects of their own each layer."""

    def __init__(self) -> None:
        self.ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._start = 0.0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        generation = info["generation"]
        self.ms[generation] += (time.perf_counter() - self._start) * 1e3
        self.count[generation] += 1

    def totals(self) -> tuple[float, ...]:
        return (*self.ms, *self.count)

    def close(self) -> None:
        gc.callbacks.remove(self._observe)


class Toggle(TrainerCallback):
    """Pauses the offload's hooks on the steps ``plan`` marks True, before the step starts; each step's peak
    allocated memory (CUDA) on ``peaks``, its packed inputs on ``packed``. ``windows``: (first step, steps) each run
    under torch.profiler, its trace summarized (``trace_summary.summarize``) onto ``profiles``. With a ``clock``
    (``HookClock``), each step's host ms in the pack and unpack hooks and their calls on ``hook_times``."""

    def __init__(
        self,
        trainer: Any,
        plan: list[bool],
        cuda: bool,
        windows: tuple[tuple[int, int], ...] = (),
        clock: HookClock | None = None,
        gc_clock: GcClock | None = None,
        freeze_at: int | None = None,
    ) -> None:
        self.trainer, self.plan, self.cuda, self.windows, self.clock = trainer, plan, cuda, windows, clock
        self.gc_clock, self.freeze_at = gc_clock, freeze_at
        self.peaks: list[float] = []
        self.packed: list[int] = []
        self.hook_times: list[tuple[float, float, int, int]] = []
        self.gc_times: list[tuple[float, ...]] = []
        self._hooks_before = (0.0, 0.0, 0, 0)
        self._gc_before: tuple[float, ...] = ()
        self.profiles: list[dict[str, Any]] = []
        self._packed_before = 0
        self._profiler: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        hooks(self.trainer).paused = self.plan[state.global_step]
        if state.global_step == self.freeze_at:  # the objects made so far (model, compiled code) leave the GC's scans
            gc.collect()
            gc.freeze()
        if self.gc_clock is not None:
            self._gc_before = self.gc_clock.totals()
        self._packed_before = stats(self.trainer).packed
        if self.clock is not None:
            self._hooks_before = self.clock.totals()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        if any(state.global_step == first for first, _ in self.windows):
            self._profiler = profiler(self.cuda)
            self._profiler.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.peaks.append(torch.cuda.max_memory_allocated() / 2**30 if self.cuda else math.nan)
        self.packed.append(stats(self.trainer).packed - self._packed_before)
        if self.gc_clock is not None:
            self.gc_times.append(tuple(a - b for a, b in zip(self.gc_clock.totals(), self._gc_before)))
        if self.clock is not None:  # the backward's unpacks are done by now: the step's loss was read
            self.hook_times.append(tuple(a - b for a, b in zip(self.clock.totals(), self._hooks_before)))
        if any(state.global_step == first + steps for first, steps in self.windows):  # global_step counts this one
            self.profiles.append(stop(self._profiler, self.cuda))
            self._profiler = None


def profiler(cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    if cuda:
        torch.cuda.synchronize()  # the window starts with an empty queue
    return profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)


def stop(prof: Any, cuda: bool) -> dict[str, Any]:
    """Stop ``prof`` and summarize its Chrome trace (written to a temporary file: the profiler's only full export)."""
    if cuda:
        torch.cuda.synchronize()
    prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return trace_summary.summarize(json.loads(path.read_text()))


class Partial(TrainerCallback):
    """Writes the pairs done so far every ``PARTIAL_EVERY`` pairs (after the step clock has timed the pair's second
    step: add it after the clock)."""

    def __init__(self, write: Any, warmup: int, pairs: int) -> None:
        self.write, self.warmup, self.pairs = write, warmup, pairs

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        done, odd = divmod(state.global_step - self.warmup, 2)
        if not odd and 0 < done < self.pairs and done % PARTIAL_EVERY == 0:
            self.write(done)


def paired_batches(trainer: Any, seed: int) -> None:
    """Each batch trained twice in a row, in a seeded order: a pair's two steps (the warm-up's length is even) train
    the same rows, so with varying lengths they have the same shapes too and each pair's ratio compares like with
    like; without this, a pair's steps trained different batches and only the summed times over many pairs estimated
    the cost, with a spread of several percent."""
    dataset = trainer.train_dataset
    rows = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
    batches = batch_rows(len(dataset), rows, seed)
    if not batches:
        raise SystemExit(f"the case's {len(dataset)} rows are fewer than a step's {rows}")
    trainer.train_dataset = dataset.select([i for batch in batches for i in (*batch, *batch)])
    trainer._get_train_sampler = lambda train_dataset=None: torch.utils.data.SequentialSampler(
        train_dataset if train_dataset is not None else trainer.train_dataset
    )


def batch_rows(count: int, rows: int, seed: int) -> list[list[int]]:
    """The batches ``paired_batches`` trains, each the indices of its ``rows`` rows, in the seeded order."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[k : k + rows] for k in range(0, count - rows + 1, rows)]


def micro_batch_tokens(case: Any, seed: int) -> int:
    """The median over the run's batches of a micro-batch's tokens: rows x length, or with varying lengths (the
    padding-free row of real tokens) the batches' summed lengths."""
    if case.kind != "varlen":
        return case.batch * case.seq
    lengths = [len(ids) for ids in vs.dataset(case)["input_ids"]]
    return int(statistics.median(sum(lengths[i] for i in b) for b in batch_rows(len(lengths), case.batch, seed)))


def plan_steps(warmup: int, pairs: int, seed: int, profile: int = 0) -> list[bool]:
    """Per step, whether the hooks are paused: the warm-up alternating (each variant's first steps compile), then
    each pair in a coin's order, then ``profile`` paused steps and ``profile`` offloaded ones."""
    coin = random.Random(seed)
    plan = [k % 2 == 1 for k in range(warmup)]
    for _ in range(pairs):
        first = coin.random() < 0.5
        plan += [first, not first]
    return plan + [True] * profile + [False] * profile


def pair_ratios(plan: list[bool], ms: list[float], compiled: list[bool], warmup: int) -> list[float]:
    """Each kept pair's paused time over its offloaded time (a pair where either step compiled is dropped)."""
    ratios = []
    for k in range(warmup, len(ms) - 1, 2):
        if compiled[k] or compiled[k + 1]:
            continue
        paused, offload = (ms[k], ms[k + 1]) if plan[k] else (ms[k + 1], ms[k])
        ratios.append(paused / offload)
    return ratios


def run(args: argparse.Namespace, out: Path | None) -> tuple[list[Row], dict[str, Any]]:
    """The rows (the pairs) and, with ``--profile``, the two profiled windows (``profile_record``; else empty)."""
    cuda = not args.smoke
    case = vs.cases(args.smoke)[args.case]
    if args.batch:
        case = dataclasses.replace(case, batch=args.batch)
    options = {"offload_checkpoints": True, **ab.parse_opts(args.opt)}
    if options.get("compile_layers") is True:
        options.setdefault("compile_layers_background", False)  # compiled in the process: the steps, not a child
    plan = plan_steps(args.warmup, args.pairs, args.seed, args.profile)
    pairs_end = args.warmup + 2 * args.pairs
    windows = ((pairs_end, args.profile), (pairs_end + args.profile, args.profile)) if args.profile else ()
    with tempfile.TemporaryDirectory() as tmp:
        vs.prepare(case, Path(tmp) / "model", cuda)
        trainer, _ = vs.hf_trainer(case, "stock", Path(tmp) / "model", str(Path(tmp) / "run"), cuda)
        if not cuda:  # the cases checkpoint on CUDA only; the offload has nothing to move without it
            for name, on in checkpointing(True).items():
                setattr(trainer.args, name, on)
        paired_batches(trainer, args.seed)
        report = leantrain.patch_trainer(trainer, **options)
        print(report, flush=True)
        if hooks(trainer) is None:
            raise SystemExit(f"offload_checkpoints was not applied: {report['offload_checkpoints']}")
        if args.keep_inputs or args.copy_bytes:
            KeptOnDevice(hooks(trainer), args.copy_bytes)
        hook_clock = HookClock(hooks(trainer)) if args.time_hooks else None
        gc_clock = GcClock() if args.time_gc else None
        freeze_at = args.warmup if args.gc_freeze else None
        toggle = Toggle(trainer, plan, cuda, windows, hook_clock, gc_clock, freeze_at)
        clock = ab.StepTimes(cuda)
        trainer.add_callback(toggle)  # before the clock: the switch is not timed
        trainer.add_callback(clock)

        def write_partial(done: int) -> None:
            write(rows_of(args, case, options, plan, clock, toggle, done), out, f"{done} of {args.pairs} pairs")

        trainer.add_callback(Partial(write_partial, args.warmup, args.pairs))  # after the clock: the pair is timed
        trainer.args.max_steps = len(plan)
        if args.logging_steps:
            trainer.args.logging_steps = args.logging_steps
        try:
            trainer.train()
        finally:
            if gc_clock is not None:
                gc_clock.close()
            if args.gc_freeze:
                gc.unfreeze()
    rows = rows_of(args, case, options, plan, clock, toggle, args.pairs)
    return rows, profile_record(toggle.profiles, [clock.ms[first : first + n] for first, n in windows])


def profile_record(profiles: list[dict[str, Any]], ms: list[list[float]]) -> dict[str, Any]:
    """The two profiled windows (paused, then offloaded) with their steps' times."""
    if len(profiles) != 2:
        return {}
    return {"steps": len(ms[0]), **{v: {"step_ms": [round(m, 2) for m in t], **p}
                                    for v, p, t in zip(VARIANTS, profiles, ms)}}  # fmt: skip


def rows_of(
    args: argparse.Namespace,
    case: Any,
    options: dict[str, Any],
    plan: list[bool],
    clock: Any,
    toggle: Toggle,
    pairs_done: int,
) -> list[Row]:
    """The two rows over the warm-up's end to the ``pairs_done``-th pair (the profiled steps after the pairs apart)."""
    end = args.warmup + 2 * pairs_done
    ratios = pair_ratios(plan[:end], clock.ms[:end], clock.compiled[:end], args.warmup)
    kept = [k for k in range(args.warmup, end) if not clock.compiled[k]]
    rows = []
    for variant in VARIANTS:
        mine = [k for k in kept if plan[k] == (variant == "paused")]
        times = sorted(clock.ms[k] for k in mine)
        config = {
            "pairs": args.pairs,
            "pairs_kept": len(ratios),
            "warmup": args.warmup,
            "seed": args.seed,
            "logging_steps": args.logging_steps or 1,
            "patch_trainer": {k: repr(v) for k, v in options.items()},
            "steps_kept": len(mine),
            "peak_gib": max((toggle.peaks[k] for k in mine), default=math.nan),
            "packed_per_step": statistics.median(toggle.packed[k] for k in mine) if mine else 0,
            "ms": [round(clock.ms[k], 2) for k in mine],
            "warmup_ms": [round(m, 1) for m in clock.ms[: args.warmup]],
            "paired_batches": True,  # a pair's two steps train the same rows (paired_batches)
            "batch": case.batch,
            "seq": case.seq,  # fixed length (or the longest a varying-length row may be)
            "tokens": micro_batch_tokens(case, args.seed),  # a micro-batch's, the median over the batches
        }  # fmt: skip
        if toggle.gc_times:
            config["gc"] = gc_summary([toggle.gc_times[k] for k in mine])
        config["gc_freeze"] = args.gc_freeze
        if args.keep_inputs or args.copy_bytes:
            config["kept_on_device"] = True  # a diagnostic run (KeptOnDevice)
            config["copy_bytes"] = args.copy_bytes or "all"
        if variant == "offload" and toggle.hook_times:
            config["hooks_host_ms"] = hook_medians([toggle.hook_times[k] for k in mine])
        if variant == "offload" and ratios:
            paused_sum = sum(clock.ms[k] for k in kept if plan[k])
            config.update(pair_ratios=[round(r, 4) for r in ratios], pair_median=statistics.median(ratios),
                          pair_interval=bootstrap_median(ratios), summed_ratio=paused_sum / sum(times),
                          geometric_mean=math.exp(statistics.fmean(math.log(r) for r in ratios)))  # fmt: skip
        rows.append(Row(NAME, variant, "step", "speed", "ms", "case", case.name, statistics.median(times),
                        percentile(times, 0.2), percentile(times, 0.8), config))  # fmt: skip
    return rows


def hook_medians(times: list[tuple[float, float, int, int]]) -> dict[str, float]:
    """The steps' medians: host ms in the pack hook, in the unpack hook, both, and each hook's calls."""
    if not times:
        return {}
    pick = {"pack": 0, "unpack": 1, "pack_calls": 2, "unpack_calls": 3}
    medians = {name: statistics.median(t[i] for t in times) for name, i in pick.items()}
    return {**medians, "both": statistics.median(t[0] + t[1] for t in times)}


def gc_summary(times: list[tuple[float, ...]]) -> dict[str, Any]:
    """Per step: the median and the most GC ms, the summed ms and counts per generation over the steps."""
    per_step = [sum(t[:3]) for t in times]
    return {
        "median_ms": statistics.median(per_step) if per_step else 0.0,
        "max_ms": max(per_step, default=0.0),
        "ms_by_generation": [round(sum(t[g] for t in times), 2) for g in range(3)],
        "count_by_generation": [sum(t[3 + g] for t in times) for g in range(3)],
    }


def write(rows: list[Row], out: Path | None, partial: str = "") -> Path:
    """JSON and markdown (a partial run's marked so, in ``config.partial`` and the text), and the plot."""
    for row in rows:
        if partial:
            row.config["partial"] = partial
    text = table(rows)
    if partial:
        text = f"**Partial: {partial} (the run did not finish).**\n\n{text}"
    where = write_results(NAME, rows, text, out)
    plot(where / f"{NAME}.png", rows[1])
    return where


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def table(rows: list[Row]) -> str:
    paused, offload = rows
    c = offload.config
    lines = [[f"{r.x_value} ({r.config.get('batch', '?')} x {r.config.get('seq', '?')})", r.provider,
              f"{r.p50:.1f} ({r.p20:.1f}-{r.p80:.1f})", r.config["steps_kept"], f"{r.config['packed_per_step']:g}",
              f"{r.config['peak_gib']:.2f}"] for r in rows]  # fmt: skip
    header = ["case (rows x tokens)", "hooks", "step ms (p20-p80)", "steps", "inputs moved a step", "peak GiB"]
    text = markdown_table(header, lines)
    if "pair_median" in c:
        low, high = c["pair_interval"]
        verdict = "within" if c["pair_median"] >= COST_LINE else "not within"
        text += (
            f"\n\nOver {c['pairs_kept']} pairs (of {c['pairs']}): the median of the pairs' ratios (paused over "
            f"offloaded; above 1 the offload is faster) **{c['pair_median']:.3f}x** (bootstrap 90% interval "
            f"{low:.3f}-{high:.3f}), geometric mean {c['geometric_mean']:.3f}x, summed times "
            f"{c['summed_ratio']:.3f}x: {verdict} 3% of the step at the median."
        )
    if c.get("hooks_host_ms"):
        h = c["hooks_host_ms"]
        cost = paused.p50 * (1 / c["pair_median"] - 1) if "pair_median" in c else math.nan
        text += (
            f"\n\nThe host inside the offload's hooks, a step (median): {h['both']:.2f} ms ({h['pack']:.2f} in "
            f"{h['pack_calls']:g} packs, {h['unpack']:.2f} in {h['unpack_calls']:g} unpacks), against a step cost of "
            f"{cost:.2f} ms at the pairs' median."
        )
    for row in rows:
        g = row.config.get("gc")
        if g:
            kinds = zip(g["count_by_generation"], g["ms_by_generation"])
            counts = ", ".join(f"{n} of generation {i} ({ms:.0f} ms)" for i, (n, ms) in enumerate(kinds))
            frozen = " (objects made before the pairs frozen out of the scans)" if row.config.get("gc_freeze") else ""
            text += (
                f"\n\nPython's garbage collections on the {row.provider} steps: {g['median_ms']:.2f} ms a step "
                f"(median), {g['max_ms']:.1f} at most; over the steps {counts}{frozen}."
            )
    if c.get("kept_on_device"):
        moved = "the whole input" if c["copy_bytes"] == "all" else f"only its first {c['copy_bytes']} bytes"
        text += (
            f"\n\n**A diagnostic run**: every input stayed on the device (no memory saved, nothing freed) and the "
            f"hooks' copies moved {moved}."
        )
    options = ", ".join(f"{k}={v}" for k, v in c["patch_trainer"].items())
    return text + (
        f"\n\nOne trainer, `patch_trainer({options})`, the offload's hooks paused (stock checkpointing) on one step "
        f"of each pair, the order drawn by a seeded coin (seed {c['seed']}); {c['warmup']} warm-up steps and the "
        "pairs where a step compiled a graph dropped; step times CUDA-synchronized at each step's start and end; "
        f"the trainer logging every {c.get('logging_steps', 1)} step(s).\n"
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
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="rows a micro-batch (default: the case's 4): more tokens a step, the same layers and host work a layer",
    )
    parser.add_argument("--warmup", type=int, default=6, help="steps before the pairs (even: both variants warm up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--logging-steps",
        type=int,
        default=0,
        help="the trainer logs every this many steps (default: the cases' 1; TRL's own default is 10); each log waits "
        "for the GPU to read the loss",
    )
    parser.add_argument("--opt", action="append", default=[], help="patch_trainer name=value (compile_layers=True)")
    parser.add_argument(
        "--profile", type=int, default=0, help="after the pairs, this many paused then offloaded steps profiled"
    )
    parser.add_argument(
        "--time-hooks", action="store_true", help="time the host inside the offload's pack and unpack hooks, a step"
    )
    parser.add_argument("--time-gc", action="store_true", help="time Python's garbage collections, a step")
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() after the warm-up: what is made before is never scanned"
    )
    parser.add_argument(
        "--copy-bytes",
        type=int,
        default=0,
        help="diagnostic: the hooks' copies move each input's first this many bytes, the input stays on the device "
        "(the calls without the traffic)",
    )
    parser.add_argument(
        "--keep-inputs",
        action="store_true",
        help="diagnostic: the inputs stay on the device, the hooks copy them whole (the calls and the traffic without "
        "the frees)",
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny case on the CPU")
    parser.add_argument(
        "--summary", nargs="+", default=[], help="these runs' JSON files in one plot (offload_toggle_summary.png)"
    )
    parser.add_argument(
        "--tradeoff",
        nargs="+",
        default=[],
        help="these runs' JSON files (and vs_unsloth JSON for Unsloth's peaks): peak against step cost per case "
        "(offload_toggle_tradeoff.png)",
    )
    parser.add_argument(
        "--by-size",
        nargs="+",
        default=[],
        help="these runs' JSON files: each run's step cost against its micro-batch's tokens "
        "(offload_toggle_by_size.png)",
    )
    parser.add_argument("--out", default="", help="results directory (default $BENCH_RESULTS or benchmarks/results)")
    args = parser.parse_args(argv)
    out = Path(args.out or os.environ.get("BENCH_RESULTS", "benchmarks/results"))
    if args.summary:
        print(summary_plot([Path(f) for f in args.summary], out / f"{NAME}_summary.png"))
        return 0
    if args.tradeoff:
        print(tradeoff_plot([Path(f) for f in args.tradeoff], out / f"{NAME}_tradeoff.png"))
        return 0
    if args.by_size:
        print(size_plot([Path(f) for f in args.by_size], out / f"{NAME}_by_size.png", AUTO_MIN_TOKENS))
        return 0
    if args.smoke:
        args.case, args.pairs, args.warmup = args.case or "tiny-llama", min(args.pairs, 4), min(args.warmup, 2)
        torch.set_num_threads(2)
    args.case = args.case or "llama-3.2-1b"
    known = vs.cases(args.smoke)
    if args.case not in known:
        raise SystemExit(f"unknown case {args.case!r}: {list(known)}")
    if known[args.case].kind == "moe":
        raise SystemExit(f"{args.case}: a MoE case builds 4-bit experts only leantrain trains; use a dense case")
    if (
        args.pairs < 1
        or args.warmup < 0
        or args.warmup % 2
        or min(args.profile, args.logging_steps, args.copy_bytes, args.batch) < 0
    ):
        raise SystemExit(
            "--pairs must be positive, --warmup even and not negative, --profile, --logging-steps, --copy-bytes and "
            "--batch not negative"
        )
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    rows, profiled = run(args, Path(args.out) if args.out else None)
    out = write(rows, Path(args.out) if args.out else None)
    print(table(rows))
    if profiled:
        text = profile_text(profiled, rows[0])
        (out / f"{NAME}_profile.json").write_text(json.dumps(profiled, indent=1))
        (out / f"{NAME}_profile.md").write_text(text)
        print(text)
    return 0


def profile_text(profiled: dict[str, Any], row: Row) -> str:
    steps = profiled["steps"]
    times = " | ".join(f"{v}: {', '.join(f'{m:.1f}' for m in profiled[v]['step_ms'])} ms" for v in VARIANTS)
    return (
        f"# {NAME}: where the step time goes\n\nDevice: {row.device}. Date: {row.date}. Commit: {row.commit}. Case: "
        f"{row.x_value}.\n\nAfter the pairs, {steps} paused steps then {steps} offloaded ones under torch.profiler "
        f"(its host overhead slows both; compare them with each other, not with the rows): {times}.\n\n"
        + trace_summary.compare_text(VARIANTS, (profiled["paused"], profiled["offload"]), steps)
    )


def summary_plot(paths: list[Path], path: Path) -> Path:
    """Each run's pair ratios as a box (its name from the file: ``offload_toggle_<case>_<run>.json``), the summed
    times' ratio as a dot, the 3% line: several cases and runs at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for file in paths:
        offload = next((r for r in json.loads(file.read_text()) if r["provider"] == "offload"), None)
        if offload is None or not offload["config"].get("pair_ratios"):
            raise SystemExit(f"{file}: no offload row with pair ratios (an offload_toggle JSON?)")
        runs.append((file.stem.removeprefix(f"{NAME}_"), offload["config"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(runs)), 4))
    ax.boxplot([c["pair_ratios"] for _, c in runs], showfliers=False)
    ax.plot(range(1, len(runs) + 1), [c["summed_ratio"] for _, c in runs], "D", color="C2", label="summed times")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(COST_LINE, color="C3", ls="--", lw=0.8, label="a 3% step cost")
    ax.set_xticks(range(1, len(runs) + 1), [name for name, _ in runs], rotation=20, fontsize=8)
    ax.set_ylabel("paused / offloaded step\n(above 1: the offload faster)", fontsize=9)
    ax.set_title("The offload's step cost a step apart: each run's pair ratios")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def trade_points(paths: list[Path]) -> tuple[dict[str, list[tuple[str, float, float]]], dict[str, float]]:
    """From offload_toggle runs' JSON, per case: (what moved, step cost, peak GiB) for stock checkpointing (the
    paused steps: cost 0) and for each run's offload (every layer, or ``offload_checkpoints_layers``); from
    ``vs_unsloth`` JSON among ``paths``, Unsloth's peak per case (the highest of its rounds)."""
    points: dict[str, list[tuple[str, float, float]]] = {}
    unsloth: dict[str, float] = {}
    for file in paths:
        rows = json.loads(file.read_text())
        for row in rows:
            if row["provider"] == "unsloth" and row.get("metric") == "memory":
                unsloth[row["x_value"]] = max(unsloth.get(row["x_value"], 0.0), row["p50"])
        paused = next((r for r in rows if r["provider"] == "paused"), None)
        offload = next((r for r in rows if r["provider"] == "offload"), None)
        if paused is None or offload is None:
            continue
        c = offload["config"]
        if "varlen" in offload["x_value"] and not c.get("paired_batches"):
            continue  # its pairs trained different batches: the lengths' spread, not the offload's cost
        if "pair_median" not in c or "peak_gib" not in c:
            raise SystemExit(f"{file}: its offload row has no pairs' median or peak (an offload_toggle JSON?)")
        layers = int(c.get("patch_trainer", {}).get("offload_checkpoints_layers", 0) or 0)
        moved = f"{layers} layers" if layers else "every layer"
        case = points.setdefault(offload["x_value"], [("stock", 0.0, paused["config"]["peak_gib"])])
        case.append((moved, 1 / c["pair_median"] - 1, c["peak_gib"]))
    return points, unsloth


def tradeoff_plot(paths: list[Path], path: Path) -> Path:
    """One panel per case: the peak GiB against the offload's step cost for stock checkpointing, each run with every
    layer and with some layers moved, beside the 3% line and Unsloth's peak (where a vs_unsloth JSON gives it):
    what each setting saves and what it costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, unsloth = trade_points(paths)
    if not points:
        raise SystemExit("no offload_toggle run among the files")
    fig, axes = plt.subplots(1, len(points), figsize=(3.6 * len(points), 3.6), squeeze=False)
    for ax, (case, marks) in zip(axes[0], sorted(points.items()), strict=True):
        for moved, color, marker in (("stock", "grey", "X"), ("every layer", "C0", "o")):
            mine = [(cost, peak) for m, cost, peak in marks if m == moved]
            ax.plot([100 * c for c, _ in mine], [p for _, p in mine], marker, color=color, label=moved, ls="none")
        some = [(m, cost, peak) for m, cost, peak in marks if m not in ("stock", "every layer")]
        for m, cost, peak in some:
            ax.plot(100 * cost, peak, "s", color="C1", label="some layers" if m == some[0][0] else None)
            ax.annotate(m, (100 * cost, peak), fontsize=7, xytext=(4, 2), textcoords="offset points")
        ax.axvline(3.0, color="C3", ls="--", lw=0.8, label="a 3% step cost")
        if case in unsloth:
            ax.axhline(unsloth[case], color="C2", ls=":", lw=1.0, label="Unsloth's peak")
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("step cost of the offload, %", fontsize=8)
        ax.set_ylabel("peak allocated GiB", fontsize=8)
        ax.legend(fontsize=7)
    fig.suptitle("What the offload saves and costs, per run (pairs' median cost)", fontsize=10)
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """``fig`` laid out and written to ``path`` (its folder made), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def size_points(paths: list[Path]) -> dict[str, list[tuple[int, float]]]:
    """From offload_toggle runs' JSON, per case: (tokens a micro-batch, step cost) of each run that moved every
    layer's input of every micro-batch (``offload_checkpoints=True``; runs of some of the layers or of auto mode are
    other trades), the varying-length runs whose pairs trained different batches left out (as in measured.py)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for file in paths:
        rows = json.loads(file.read_text())
        offload = next((r for r in rows if r["provider"] == "offload"), None)
        if offload is None or "pair_median" not in offload["config"]:
            raise SystemExit(f"{file}: no offload row with a pairs' median (an offload_toggle JSON?)")
        c, case = offload["config"], offload["x_value"]
        trainer = c.get("patch_trainer", {})
        if str(trainer.get("offload_checkpoints")) != "True" or int(trainer.get("offload_checkpoints_layers") or 0):
            continue
        if "varlen" in case and not c.get("paired_batches"):
            continue
        tokens = c.get("tokens")
        if not tokens:  # runs written before the rows carried it: the case's batches under the run's seed
            tokens = micro_batch_tokens(dataclasses.replace(vs.cases(False)[case], batch=c.get("batch", 4)), c["seed"])
        points.setdefault(case, []).append((int(tokens), 1 / c["pair_median"] - 1))
    return points


def size_plot(paths: list[Path], path: Path, min_tokens: int) -> Path:
    """Each run's step cost against its micro-batch's tokens, per case, beside the 3% line and the size from which
    auto mode moves the inputs (``min_tokens``): the cost falls as the GPU gets more work a layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = size_points(paths)
    if not points:
        raise SystemExit("no run among the files moved every layer's input (offload_checkpoints=True)")
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for i, (case, marks) in enumerate(sorted(points.items())):
        shift = 1 + 0.025 * (i - (len(points) - 1) / 2)  # side by side at a size, not on top of each other
        ax.plot([t * shift for t, _ in marks], [100 * c for _, c in marks], "o", ms=5, alpha=0.75, label=case)
    ax.set_xscale("log", base=2)
    sizes: list[int] = []
    for t in sorted({t for marks in points.values() for t, _ in marks}):
        if not sizes or t > 1.1 * sizes[-1]:  # one label for sizes within 10% of each other (varying lengths' seeds)
            sizes.append(t)
    ax.set_xticks(sizes, [f"{t:,}" for t in sizes], fontsize=7, rotation=30)
    ax.minorticks_off()
    ax.axhline(3.0, color="C3", ls="--", lw=0.8, label="a 3% step cost")
    ax.axhline(0.0, color="grey", lw=0.6)
    ax.axvline(min_tokens, color="black", ls=":", lw=1.2, label=f"auto mode moves from {min_tokens:,} tokens")
    ax.set_xlabel("tokens a micro-batch (varying lengths: the median of the batches' sums)", fontsize=8)
    ax.set_ylabel("step cost of the offload, %\n(each dot a run: its pairs' median)", fontsize=8)
    ax.set_title("The offload's step cost by micro-batch size, every layer moved", fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
