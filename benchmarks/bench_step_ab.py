"""One trainer in one process, its training step stock and patched in alternating segments (stock, leantrain, stock,
leantrain, ...): a shared GPU drifts by up to 15% between processes and over minutes, which a comparison of separate
processes (``bench_vs_unsloth.py``) cannot tell from a real difference of a few percent. Each segment is a
``trainer.train()`` of ``--steps`` steps whose first step is dropped (optimizer creation, caches); ``patch_trainer``
before each leantrain segment, ``unpatch_trainer`` after it, so both variants train the same model on the same data.
With ``--base-opt``, the first variant is ``patch_trainer`` with those options instead of stock (e.g. leantrain
without and with an option).

The case is one of ``bench_vs_unsloth.py``'s (its shapes, data, LoRA and trainer settings; a MoE case builds its
experts in 4-bit as leantrain's provider does there, so it compares two ``--base-opt`` / ``--opt`` variants);
``--opt name=value`` passes options to ``patch_trainer`` (e.g. ``--opt compile_layers=False`` for what a short run
gets; with ``compile_layers=True`` the layers compile in the process unless ``compile_layers_background`` is given).
``--profile`` adds one profiled segment per variant and writes its kernels by GPU time and the GPU's timeline over
the segment's steps (``step_ab_<case>_<variant>_profile.txt``): time with a kernel running, idle time (the GPU
waited on the host), and the copies each way with the part no kernel ran beside (a copy that did not hide);
``--trace`` also writes the Chrome trace. ``--memory`` adds a segment of ``--memory-steps`` steps (2 by default) per
variant and writes the peak allocated memory of each phase (each layer's forward and backward, the head and loss, the
optimizer) of the step that peaked highest after the first (with varying lengths, the longest batch: give it as many
steps as the timed segments): ``step_ab_<case>_<variant>_memory.txt`` says where in the step the peak is.
``--compile-times`` writes torch.compile's seconds per phase over the run (``<name>_<case>_compile_times.txt``); each
segment's line gives its first step's time (the compile, for the first segment of a compiled variant; the rows keep
them, ``first_step_ms``). ``--inductor name=value`` sets a ``torch._inductor.config`` entry for the whole run (what
a compile costs against what its kernels run: e.g. ``triton.autotune_pointwise=False``); ``--opt-inductor
name=value`` one for the second variant's segments only, whose patch compiles anew in each (an A/B of an inductor
setting in one process: ``--base-opt compile_layers=True --opt compile_layers=True --opt-inductor
triton.cudagraphs=True``).

    python benchmarks/bench_step_ab.py --case qwen2.5-1.5b --opt compile_layers=False --profile   # CUDA, ~2 min
    python benchmarks/bench_step_ab.py --case llama-3.2-1b --base-opt compile_layers=True \\
        --opt compile_layers=True --opt offload_checkpoints=True --profile --trace  # what the offload costs a step
    python benchmarks/bench_step_ab.py --smoke                                                      # CPU, seconds

Steps after a segment's first that compiled a graph (Dynamo's count moved: a new shape, e.g. a longer batch than any
before) are dropped too and counted in the rows. Rows (median step of each variant over all its segments, each
segment's median, the ratio to stock, the median over the pairs of each pair's ratio, which cancels the host's
drift between pairs, and the same over the same batches: every segment replays the run's batches from its seeded
sampler, so a pair's steps at the same position where neither compiled train the same batch, and the ratio of
their summed times is the cost on those batches, which with varying lengths the segment medians confound when one
segment drops its compiling long batch) go to ``step_ab.json`` / ``.md`` in ``$BENCH_RESULTS`` or
``benchmarks/results``. With varying lengths, give ``--steps`` enough steps that each segment times some of the
longest batches after the one that compiles their graph. After each pair but the last, the pairs done so far are
written under the same name (marked partial, in the JSON's ``config.partial`` and the markdown), so a run that its
time limit stops keeps them; the finished run overwrites them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import bench_vs_unsloth as vs
import torch
from _harness import Row, markdown_table, write_results
from trace_summary import union
from transformers import TrainerCallback

import leantrain


NAME = "step_ab"
VARIANTS = ("stock", "leantrain")  # "stock" is "base" with --base-opt


def graphs_compiled() -> int:
    """Dynamo's count of the graphs it compiled in this process (each new shape or guard adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class StepTimes(TrainerCallback):
    """CUDA-synchronized wall time of every optimizer step, appended to ``ms``; ``compiled`` holds, per step, whether
    Dynamo compiled a graph during it (a step that compiles times the compiler, not the step); ``batches``, per step,
    the shapes of the ``input_ids`` of each forward (``watch``): which batch the step trained on, read without a
    host sync."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.ms, self.compiled, self.start = cuda, [], [], 0.0
        self.graphs, self.peak_gib, self.first_ms = 0, math.nan, math.nan
        self.batches: list[tuple[tuple[int, ...], ...]] = []
        self._shapes: list[tuple[int, ...]] = []

    def watch(self, model: torch.nn.Module) -> None:
        """Record the shape of ``input_ids`` at each call of ``model`` (the trainer's, once per micro-batch)."""

        def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._shapes.append(tuple(ids.shape) if isinstance(ids, torch.Tensor) else ())

        model.register_forward_pre_hook(hook, with_kwargs=True)

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.graphs = graphs_compiled()
        self._shapes = []
        self.start = self._now()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ms.append((self._now() - self.start) * 1e3)
        self.compiled.append(graphs_compiled() > self.graphs)
        self.batches.append(tuple(self._shapes))

    def steps(self) -> list[Step]:
        """The last segment's steps, its first included."""
        return [Step(*step) for step in zip(self.ms, self.compiled, self.batches, strict=True)]


class Step(NamedTuple):
    ms: float
    compiled: bool  # Dynamo compiled a graph during the step
    batch: tuple[tuple[int, ...], ...]  # the input_ids shape of each micro-batch


def parse_opts(pairs: list[str]) -> dict[str, Any]:
    """``name=value`` pairs as ``patch_trainer`` keywords (values as Python literals, else strings)."""
    opts = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--opt takes name=value, got {pair!r}")
        try:
            opts[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            opts[name] = value
    return opts


def segment(trainer: Any, clock: StepTimes, steps: int) -> tuple[list[float], int]:
    """One ``train()`` of ``steps`` steps: the times of the steps after the first that compiled nothing, and how
    many after the first compiled (a new shape's graph: with varying lengths, a longer batch than any before); its
    peak allocated GiB on ``clock.peak_gib``, weights included."""
    clock.ms, clock.compiled, clock.batches = [], [], []
    trainer.args.max_steps = steps
    if clock.cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    clock.peak_gib = torch.cuda.max_memory_allocated() / 2**30 if clock.cuda else math.nan
    clock.first_ms = clock.ms[0] if clock.ms else math.nan
    kept = [ms for ms, compiled in zip(clock.ms[1:], clock.compiled[1:], strict=True) if not compiled]
    return kept, sum(clock.compiled[1:])


def profiled(trainer: Any, clock: StepTimes, steps: int, path: Path, trace: bool = False) -> None:
    """One segment under torch.profiler, its first step left out: the kernels and ops of the other steps by GPU time
    (CPU time on a CPU run); on CUDA the GPU's timeline over those steps (``timeline``). ``trace``: also the Chrome
    trace beside ``path`` (``<stem>_trace.json``, for chrome://tracing or Perfetto)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    class ProfilerStep(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            prof.step()

    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps - 1, repeat=1)) as prof:
        stepper = ProfilerStep()
        trainer.add_callback(stepper)
        try:
            segment(trainer, clock, steps)
            ms = clock.ms[1:]  # every profiled step, a compiling one too (the profile holds it)
        finally:
            trainer.remove_callback(stepper)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    head = f"steps after the first: {', '.join(f'{m:.1f}' for m in ms)} ms (under the profiler)\n"
    if cuda:
        head += timeline_text(timeline(device_intervals(prof.events()), sum(ms)), sum(ms))
    if trace:
        prof.export_chrome_trace(str(path.with_name(path.stem + "_trace.json")))
    path.write_text(head + events.table(sort_by=key, row_limit=40, max_name_column_width=70))
    print(f"profile: {path}", flush=True)


def memory_segment(trainer: Any, phases: PeakPhases, clock: StepTimes, path: Path, steps: int = 2) -> None:
    """``steps`` steps with the peak allocated memory read at each phase (``phases``, a callback of the trainer; the
    highest step after the first kept), written to ``path``: where in the step the peak is."""
    try:
        segment(trainer, clock, steps)
    finally:
        phases.remove()
    path.write_text(phases.text())
    print(f"memory: {path}", flush=True)


class PeakPhases(TrainerCallback):
    """The peak allocated memory of each phase of a step: each decoder layer's forward, the rest of the forward after
    the last layer (norm, head, loss), each layer's backward (from the gradient of its output on) and what follows
    (embeddings, optimizer). Read from the allocator's host-side counters at hooks: no synchronization. Of the steps
    after the first (whose compile and first allocations are not the run's), the one that peaked highest is kept,
    with its tokens (layer 0's input; a step of one only if there is no other). A checkpoint's recompute marks
    nothing (its hooks run inside the backward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from leantrain.fallback import recomputing

        self.recomputing = recomputing
        self.layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        self.phases: list[tuple[str, float]] = []  # the step being read
        self.kept: list[tuple[str, float]] = []  # the highest step after the first
        self.steps, self.tokens, self.kept_step, self.kept_tokens = 0, 0, 0, 0
        self.current = "step start"
        self.handles = [layer.register_forward_pre_hook(self._before(i)) for i, layer in enumerate(self.layers)]
        self.handles += [layer.register_forward_hook(self._after(i)) for i, layer in enumerate(self.layers)]

    def _before(self, i: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            if not self.recomputing():
                if i == 0 and args and isinstance(args[0], torch.Tensor):
                    self.tokens = args[0].shape[:-1].numel()
                self.mark(f"forward layer {i}")

        return hook

    def _after(self, i: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if self.recomputing() or not isinstance(out, torch.Tensor) or not out.requires_grad:
                return
            out.register_hook(lambda grad: self.mark(f"backward layer {i}"))
            if i == len(self.layers) - 1:
                self.mark("after the last layer (norm, head, loss)")

        return hook

    def mark(self, phase: str) -> None:
        self.phases.append((self.current, torch.cuda.max_memory_allocated() / 2**30))
        torch.cuda.reset_peak_memory_stats()
        self.current = phase

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.phases, self.current = [], "step start (before layer 0)"
        torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.mark("step end")
        self.steps += 1
        top = max(gib for _, gib in self.phases)
        if self.steps == 2 or not self.kept or (self.steps > 2 and top > max(gib for _, gib in self.kept)):
            self.kept, self.kept_step, self.kept_tokens = self.phases, self.steps, self.tokens

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def text(self) -> str:
        if not self.kept:
            return "no step recorded\n"
        top = max(gib for _, gib in self.kept)
        which = f"step {self.kept_step} of {self.steps}, {self.kept_tokens} tokens"
        lines = [f"peak allocated of the highest step ({which}): {top:.3f} GiB, by phase (weights included):"]
        lines += [f"{gib:8.3f} GiB  {phase}{'  <- peak' if gib == top else ''}" for phase, gib in self.kept]
        return "\n".join(lines) + "\n"


def device_intervals(events: Any) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel and copy the GPU ran: device-side events only, not the step or
    ``record_function`` annotations that span them."""
    from torch.autograd import DeviceType

    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith("ProfilerStep")
    ]


def uncovered(span: tuple[float, float], cover: list[tuple[float, float]]) -> float:
    """The part of ``span`` outside the (merged, sorted) ``cover``."""
    start, end = span
    inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in cover if a < end and b > start)
    return end - start - inside


def timeline(intervals: list[tuple[str, float, float]], wall_ms: float) -> dict[str, float]:
    """What the GPU did over ``wall_ms`` of steps, in ms: ``kernels`` (time some kernel ran), ``busy`` (some kernel or
    copy), ``idle`` (neither: the GPU waited on the host), and per copy direction its total and ``exposed`` part (no
    kernel ran beside it: a copy that did not hide under compute)."""
    kernels = union([(a, b) for name, a, b in intervals if not name.startswith("Memcpy")])
    out = {
        "kernels": sum(b - a for a, b in kernels) / 1e3,
        "busy": sum(b - a for a, b in union([(a, b) for _, a, b in intervals])) / 1e3,
    }
    for key, tag in (("d2h", "DtoH"), ("h2d", "HtoD")):
        copies = [(a, b) for name, a, b in intervals if name.startswith("Memcpy") and tag in name]
        out[key] = sum(b - a for a, b in copies) / 1e3
        out[f"{key}_exposed"] = sum(uncovered(c, kernels) for c in copies) / 1e3
    out["idle"] = wall_ms - out["busy"]
    return out


def timeline_text(t: dict[str, float], wall_ms: float) -> str:
    return (
        f"GPU over {wall_ms:.1f} ms of steps: kernels {t['kernels']:.1f} ms, "
        f"busy (kernels or copies) {t['busy']:.1f} ms, "
        f"idle {t['idle']:.1f} ms ({t['idle'] / wall_ms:.0%}: waiting on the host)\n"
        f"copies device->host {t['d2h']:.1f} ms ({t['d2h_exposed']:.1f} ms with no kernel beside it), "
        f"host->device {t['h2d']:.1f} ms ({t['h2d_exposed']:.1f} ms with no kernel beside it)\n"
    )


def run(args: argparse.Namespace) -> list[Row]:
    cuda = not args.smoke
    case = vs.cases(args.smoke)[args.case or ("tiny-llama" if args.smoke else "qwen2.5-1.5b")]
    opts, base = parse_opts(args.opt), parse_opts(args.base_opt)
    for given in (opts, base):  # compiled layers compile in the process: an A/B of steps, not of a run's first minute
        if given.get("compile_layers") is True:
            given.setdefault("compile_layers_background", False)
    opt_inductor = inductor_settings(args.opt_inductor)
    out_dir = Path(args.out) if args.out else None
    times: dict[str, list[list[float]]] = {v: [] for v in VARIANTS}
    steps: dict[str, list[list[Step]]] = {v: [] for v in VARIANTS}  # every step of each timed segment
    peaks: dict[str, list[float]] = {v: [] for v in VARIANTS}
    firsts: dict[str, list[float]] = {v: [] for v in VARIANTS}
    dropped: dict[str, int] = dict.fromkeys(VARIANTS, 0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        vs.prepare(case, model_dir, cuda)
        # a MoE case compares two leantrain variants on 4-bit experts (what bench_vs_unsloth's leantrain builds)
        build = "leantrain" if case.kind == "moe" else "stock"
        trainer, _ = vs.hf_trainer(case, build, model_dir, str(Path(tmp) / "run"), cuda)
        clock = StepTimes(cuda)
        trainer.add_callback(clock)
        clock.watch(trainer.model)
        extra = ["profile"] * 2 * args.profile + ["memory"] * 2 * args.memory
        for k in range(2 * args.pairs + len(extra)):
            variant = VARIANTS[k % 2]
            own = opt_inductor if variant == "leantrain" else {}
            with inductor_config(own):  # the segment's compiles (its patch compiles anew) under its settings
                patched = variant == "leantrain" or bool(base)
                if patched:
                    report = leantrain.patch_trainer(trainer, **(opts if variant == "leantrain" else base))
                    if k < 2:
                        print(report, flush=True)
                if k >= 2 * args.pairs:
                    kind = extra[k - 2 * args.pairs]
                    path = (out_dir or Path(tmp)) / f"{NAME}_{case.name}_{variant}_{kind}.txt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if kind == "profile":
                        profiled(trainer, clock, args.steps, path, args.trace)
                    else:
                        phases = PeakPhases(trainer.model)
                        trainer.add_callback(phases)
                        try:
                            memory_segment(trainer, phases, clock, path, args.memory_steps)
                        finally:
                            trainer.remove_callback(phases)
                else:
                    kept, compiling = segment(trainer, clock, args.steps)
                    times[variant].append(kept)
                    steps[variant].append(clock.steps())
                    dropped[variant] += compiling
                    peaks[variant].append(clock.peak_gib)
                    firsts[variant].append(clock.first_ms)
                    first = f" (first step {clock.first_ms / 1e3:.1f} s)" if not math.isnan(clock.first_ms) else ""
                    more = f"; {compiling} more steps compiled, dropped" if compiling else ""
                    print(f"segment {k + 1}: {variant} {median_or_nan(kept):.1f} ms{first}{more}", flush=True)
                if patched:
                    leantrain.unpatch_trainer(trainer)
            if k % 2 and k < 2 * args.pairs - 1:  # a pair done and more to come: what a run cut short leaves
                rows = rows_of(case.name, opts, base, times, peaks, args.name, steps)
                write_partial(args, out_dir, with_run_config(rows, args, firsts, dropped, opt_inductor), (k + 1) // 2)
    rows = rows_of(case.name, opts, base, times, peaks, args.name, steps)
    return with_run_config(rows, args, firsts, dropped, opt_inductor)


def with_run_config(
    rows: list[Row], args: argparse.Namespace, firsts: dict[str, list[float]], dropped: dict[str, int],
    opt_inductor: dict[str, Any],
) -> list[Row]:  # fmt: skip
    """``rows`` (one a variant, in ``VARIANTS`` order) with the run's first steps, dropped steps and settings."""
    for row, variant in zip(rows, VARIANTS, strict=True):
        row.config["first_step_ms"] = [round(ms, 1) for ms in firsts[variant]]
        row.config["compiling_steps_dropped"] = dropped[variant]
        own = opt_inductor if variant == "leantrain" else {}
        row.config["inductor"] = {k: repr(v) for k, v in {**inductor_settings(args.inductor), **own}.items()}
        row.config["own_inductor"] = {k: repr(v) for k, v in own.items()}
    return rows


def write_partial(args: argparse.Namespace, out_dir: Path | None, rows: list[Row], done: int) -> None:
    """The rows of the pairs done so far, under the run's name (the finished run overwrites them): a run that its
    time limit stops keeps its pairs."""
    for row in rows:
        row.config["partial"] = f"{done} of {args.pairs} pairs"
    note = f"\n**Partial: {done} of {args.pairs} pairs** (written while the run went on; it did not finish).\n"
    write_results(args.name, rows, table(rows) + note, out_dir)


def inductor_settings(pairs: list[str]) -> dict[str, Any]:
    """``--inductor name=value`` pairs as ``torch._inductor.config`` settings (dotted names reach its sub-configs,
    e.g. ``triton.autotune_pointwise=False``); an unknown name stops the run before any work."""
    from torch._inductor import config

    settings = parse_opts(pairs)
    for name in settings:
        owner, _, leaf = name.rpartition(".")
        target = config
        for part in owner.split(".") if owner else []:
            target = getattr(target, part, None)
        if target is None or not hasattr(target, leaf):
            raise SystemExit(f"--inductor: torch._inductor.config has no {name!r}")
    return settings


def cudagraph_skips() -> int:
    """How many compiled graphs inductor ran without the CUDA graphs it was asked for (``triton.cudagraphs``)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def inductor_config(settings: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """``torch._inductor.config`` with ``settings`` for the block (what compiles inside it), as before after it."""
    from torch._inductor import config

    return config.patch(settings) if settings else contextlib.nullcontext()


def apply_inductor_settings(settings: dict[str, Any]) -> None:
    """Set them for the whole process (both variants compile under them)."""
    from torch._inductor import config

    for name, value in settings.items():
        owner, _, leaf = name.rpartition(".")
        target = config
        for part in owner.split(".") if owner else []:
            target = getattr(target, part)
        setattr(target, leaf, value)


def rows_of(
    case: str,
    opts: dict[str, Any],
    base: dict[str, Any],
    times: dict[str, list[list[float]]],
    peaks: dict[str, list[float]],
    name: str = NAME,
    steps: dict[str, list[list[Step]]] | None = None,
) -> list[Row]:
    rows = []
    medians = {variant: [median_or_nan(seg) for seg in segments] for variant, segments in times.items()}
    steps = steps or {}
    for variant, segments in times.items():
        options = opts if variant == "leantrain" else base
        flat = [ms for seg in segments for ms in seg] or [math.nan]
        qs = statistics.quantiles(flat, n=10) if len(flat) >= 2 else flat * 9
        config = {
            "segment_medians_ms": [round(m, 2) for m in medians[variant]],
            "patch_trainer": {k: repr(v) for k, v in options.items()},
            "patched": variant == "leantrain" or bool(base),
            "peak_gib": max(peaks[variant], default=math.nan),
            "pair_speedup": median_or_nan(pair_speedups(medians[VARIANTS[0]], medians[variant])),
        }
        if steps:
            ratios, matched = same_batch_speedups(steps[VARIANTS[0]], steps[variant])
            config["same_batch_speedup"] = median_or_nan(ratios)
            config["same_batch_steps"] = matched
            config["same_batch_pair_speedups"] = [round(r, 4) for r in ratios]
            config["steps"] = [step_record(segment) for segment in steps[variant]]
        who = "base" if variant == "stock" and base else variant
        rows.append(Row(name, who, "step", "speed", "ms", "case", case, statistics.median(flat), qs[1], qs[7], config))
    return rows


def step_record(segment: list[Step]) -> dict[str, list[Any]]:
    """One segment's steps for the JSON: each step's time, whether it compiled, and the tokens it trained on (the
    input_ids elements over its micro-batches), so a reader can see which batches a variant's cost falls on."""
    return {
        "ms": [round(step.ms, 2) for step in segment],
        "compiled": [step.compiled for step in segment],
        "tokens": [sum(math.prod(shape) for shape in step.batch) for step in segment],
    }


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def pair_speedups(first: list[float], second: list[float]) -> list[float]:
    """Each pair's first-variant segment median over the second's: the two segments ran a second or two apart, so the
    host's drift over the run (up to 40% on a shared machine) cancels in the ratio, which the pooled median of every
    step does not cancel. A pair with a segment whose every timed step compiled has no ratio."""
    return [a / b for a, b in zip(first, second, strict=True) if not (math.isnan(a) or math.isnan(b))]


def same_batch_speedups(first: list[list[Step]], second: list[list[Step]]) -> tuple[list[float], list[int]]:
    """Per pair of segments, the first variant's time over the second's on the same batches: the steps at the same
    position after the first (each segment replays the run's batches from its seeded sampler) where neither compiled
    and the inputs' shapes match, their times summed (how much longer those batches train; with varying lengths the
    pair's medians can come from different batches when one segment drops a compiling step). Returns the ratio of
    each pair that has such steps, and how many steps each pair matched."""
    ratios, matched = [], []
    for a, b in zip(first, second, strict=True):
        same = [(x.ms, y.ms) for x, y in zip(a[1:], b[1:]) if not (x.compiled or y.compiled) and x.batch == y.batch]
        matched.append(len(same))
        if same:
            ratios.append(sum(x for x, _ in same) / sum(y for _, y in same))
    return ratios, matched


def options_text(row: Row) -> str:
    if not row.config["patched"]:
        return "stock (not patched)"
    text = "patch_trainer(" + ", ".join(f"{k}={v}" for k, v in row.config["patch_trainer"].items()) + ")"
    own = row.config.get("own_inductor", {})
    return text + "".join(f", inductor {k}={v}" for k, v in own.items())


def table(rows: list[Row]) -> str:
    first = {r.x_value: r.p50 for r in rows[::-1]}  # the first variant of each case (stock, or base)
    lines = [
        (r.x_value, r.provider, options_text(r), f"{r.p50:.1f}", f"{r.p20:.1f}-{r.p80:.1f}",
         ", ".join(f"{m:.1f}" for m in r.config["segment_medians_ms"]), f"{first[r.x_value] / r.p50:.3f}x",
         f"{r.config.get('pair_speedup', math.nan):.3f}x", same_batch_text(r),
         f"{r.config.get('peak_gib', math.nan):.2f}")
        for r in rows
    ]  # fmt: skip
    base = rows[0].provider if rows else "stock"
    head = ["case", "variant", "what runs", "median step ms", "p20-p80", "segment medians (in run order)",
            f"speed-up vs {base}", f"speed-up vs {base}, median of the pairs",
            f"speed-up vs {base} on the same batches, median of the pairs (steps matched a pair)",
            "peak alloc GiB"]  # fmt: skip
    dropped = sum(r.config.get("compiling_steps_dropped", 0) for r in rows)
    note = f"; {dropped} later steps that compiled a graph (a new shape) dropped too" if dropped else ""
    return (
        markdown_table(head, lines) + "\n\nOne trainer in one process, the two variants in alternating segments; each "
        f"segment's first step dropped{note}. The median of the pairs: of each pair's segment-median ratio (the "
        "host's drift cancels within a pair). On the same batches: each segment replays the run's batches, so a "
        "pair's steps at the same position train the same batch; over those where neither compiled and the inputs' "
        "shapes match, the ratio of the two variants' summed times (a batch dropped from one segment is dropped "
        "from the other), median over the pairs.\n"
    )


def same_batch_text(row: Row) -> str:
    speedup, matched = row.config.get("same_batch_speedup", math.nan), row.config.get("same_batch_steps", [])
    if math.isnan(speedup):
        return "– (no step matched: other shapes)" if matched else "–"
    return f"{speedup:.3f}x ({', '.join(map(str, matched))})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny case on the CPU")
    parser.add_argument("--case", default="", help="a bench_vs_unsloth.py case (default: qwen2.5-1.5b)")
    parser.add_argument("--opt", action="append", default=[], help="name=value for patch_trainer (repeatable)")
    parser.add_argument(
        "--base-opt",
        action="append",
        default=[],
        help="name=value: the first variant is patched with these (repeatable)",
    )
    parser.add_argument("--pairs", type=int, default=3, help="stock / leantrain segment pairs")
    parser.add_argument("--steps", type=int, default=6, help="steps a segment (the first is dropped)")
    parser.add_argument("--profile", action="store_true", help="a profiled segment per variant")
    parser.add_argument("--trace", action="store_true", help="with --profile: also each segment's Chrome trace")
    parser.add_argument("--memory", action="store_true", help="the peak of each phase of a step, per variant (CUDA)")
    parser.add_argument(
        "--memory-steps", type=int, default=2, help="steps of the --memory segment (its highest step after the first)"
    )
    parser.add_argument(
        "--compile-times", action="store_true", help="write torch.compile's time per phase (Dynamo, AOT, inductor)"
    )
    parser.add_argument(
        "--inductor",
        action="append",
        default=[],
        help="name=value: a torch._inductor.config setting for the whole run (repeatable; e.g. "
        "triton.autotune_pointwise=False, compile_threads=8)",
    )
    parser.add_argument(
        "--opt-inductor",
        action="append",
        default=[],
        help="name=value: a torch._inductor.config setting for the second variant's segments only (repeatable; e.g. "
        "triton.cudagraphs=True with compile_layers=True in both variants)",
    )
    parser.add_argument("--out", default="", help="results directory (default $BENCH_RESULTS or benchmarks/results)")
    parser.add_argument("--name", default=NAME, help=f"the results' file name (default {NAME})")
    args = parser.parse_args(argv)
    if args.trace and not args.profile:
        raise SystemExit("--trace needs --profile (the trace is the profiled segment's)")
    if args.steps < 2 or args.pairs < 1:  # a profiled segment needs one step after the first too
        raise SystemExit("--steps must be at least 2 (the first is dropped) and --pairs at least 1")
    if args.memory and args.smoke:
        raise SystemExit("--memory reads the CUDA allocator's counters: not with --smoke")
    if args.memory_steps < 2:
        raise SystemExit("--memory-steps must be at least 2 (the first step is not kept)")
    known = vs.cases(args.smoke)
    if args.case and args.case not in known:
        raise SystemExit(f"unknown case {args.case!r}: {list(known)}")
    if known.get(args.case) and known[args.case].kind == "moe" and not args.base_opt:
        raise SystemExit(
            f"{args.case} builds its experts in 4-bit (quantize_experts_4bit), which stock cannot train: compare two "
            "leantrain variants with --base-opt (e.g. --base-opt compile_layers=False --opt compile_layers=True)"
        )
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke)")
    apply_inductor_settings(inductor_settings(args.inductor))
    inductor_settings(args.opt_inductor)  # an unknown name stops here
    if args.smoke:
        torch.set_num_threads(2)
    rows = run(args)
    text = table(rows)
    if args.inductor:
        text += f"\ntorch._inductor.config for the whole run: {', '.join(args.inductor)}.\n"
    if args.opt_inductor:
        text += f"\ntorch._inductor.config for the second variant's segments: {', '.join(args.opt_inductor)}.\n"
    skips = cudagraph_skips()
    if skips:  # inductor ran those graphs without CUDA graphs (the reason is in its perf_hints log)
        text += f"\nInductor skipped CUDA graphs on {skips} compiled graphs (TORCH_LOGS=perf_hints says why).\n"
    write_results(args.name, rows, text, Path(args.out) if args.out else None)
    print(text)
    if args.compile_times:
        write_compile_times(Path(args.out) if args.out else None, args.name, rows[0].x_value if rows else "")


def write_compile_times(out: Path | None, name: str, case: str) -> Path:
    """torch.compile's seconds per timed phase over the whole run, summed over its graphs (Dynamo's tracing, AOT
    autograd, inductor's lowering and code generation, the wait for the kernels' compilation): where a compiled
    variant's first step goes."""
    from torch._dynamo.utils import compile_times

    path = (out or Path(__file__).resolve().parent / "results") / f"{name}_{case}_compile_times.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(compile_times(repr="str", aggregate=True)) + "\n")
    print(path.read_text(), flush=True)
    return path


if __name__ == "__main__":
    main()
