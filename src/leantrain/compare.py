"""``leantrain compare``: what one line buys, measured on your own training run.

``leantrain compare [--steps N] [--warmup W] [--json PATH] [--plot PATH] [--keep] [run options] TARGET [ARGS ...]``

TARGET is what ``leantrain run`` takes (a Python file, ``-m MODULE`` or an installed console script, then its own
arguments); the run options (``--cggr``, ``--opt NAME=VALUE``, ...) are ``leantrain run``'s and apply to the
leantrain runs. The target trains four times, N optimizer steps each, each run in its own process started as
``python -m leantrain run --measure=SPEC TARGET ARGS``, in the order stock, leantrain, leantrain, stock (so neither
mode always meets the first-time costs): stock is the kill switch (``LEANTRAIN_DISABLE=1``: nothing patched), and
leantrain is what ``leantrain run`` does. The hook that ``leantrain run`` installs caps the steps, times them and
ends the process after the first ``train()`` (``_measure``); nothing in the script changes. Same script, seed and
data in every run, so every run sees the same batches; GRPO / RLOO runs all train on the completions the first run
sampled (each still samples, so its step time includes generation).

Then it prints, side by side: the patch report, step time (median and p20-p80 after the warm-up steps), peak memory
(CUDA max allocated, or the process's peak RSS on CPU), tokens/s and the per-step losses against a bound derived
from the dtype's rounding; and a verdict: "faster by x" (or slower, or leaner) with "same losses", "within noise:
no claim", "losses differ from step k", or "nothing applied: no claim". It writes the numbers to ``--json`` and loss
curves and step-time distributions to ``--plot``; ``--keep`` writes what helped into ``./leantrain.json``, which
``leantrain run`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import _keep
from ._measure import OPTION, Measurement, MeasureSpec
from .config import LeantrainConfig


USAGE = (
    "leantrain compare [--steps N] [--warmup W] [--json PATH] [--plot PATH] [--keep] [run options] "
    "(FILE | -m MODULE | CONSOLE_SCRIPT) [ARGS ...]"
)
ORDER = ("stock", "leantrain", "leantrain", "stock")
MODES = ("stock", "leantrain")
# compare's own options and how many values each takes; everything else before the target is leantrain run's
OWN = {"--steps": 1, "--warmup": 1, "--json": 1, "--plot": 1, "--keep": 0, "-h": 0, "--help": 0}
# Unit roundoff of each compute dtype: one rounding moves a value by at most u of itself.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
LAYERS_UNKNOWN = 32  # rounding depth assumed when the model does not say how many decoder layers it has
CHECKED_METRICS = ("grad_norm", "entropy")  # held to the loss's rule too, where every run logs them
LEANER = 0.01  # a peak-memory difference is a claim only beyond 1% and when every run of one mode is below the other
NOT_FOLLOWED = ("torchrun", "torch.distributed.run", "deepspeed")  # start workers as plain python: not measured


@dataclass(frozen=True)
class CompareRequest:
    steps: int
    warmup: int
    json_path: str
    plot_path: str
    keep: bool
    run_options: tuple[str, ...]  # leantrain run's options, for the leantrain runs
    target: tuple[str, ...]  # the target and its arguments, as typed
    options: dict[str, Any]  # the run options parsed (patch_trainer keywords)


# --- the command line --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leantrain compare",
        usage=USAGE,
        description="Train your script N steps stock and N steps with leantrain (twice each, in separate "
        "processes, same seed and batches) and say what it buys: step time, peak memory, tokens/s, losses.",
        epilog="Options between compare's own and the target are leantrain run's (--cggr, --opt NAME=VALUE, ...) "
        "and apply to the leantrain runs. Run it outside any launcher; a target that runs `accelerate launch` "
        "is measured on rank 0.",
        allow_abbrev=False,
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="first steps of each run left out of the timing (default 2)"
    )
    parser.add_argument("--json", default="compare.json", metavar="PATH", help="numbers (default compare.json)")
    parser.add_argument("--plot", default="compare.png", metavar="PATH", help="PNG (default compare.png)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="write what helped (and turn off what did not) into ./leantrain.json, which `leantrain run` reads",
    )
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(compare's options, leantrain run's options, target and its args)."""
    own: list[str] = []
    run: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if token == "--":
            return own, run, argv[i + 1 :]
        if token == "-m" or (token.startswith("-m") and not token.startswith("--")) or not token.startswith("-"):
            return own, run, argv[i:]
        takes = 0 if "=" in token else OWN.get(name, 1 if token == "--opt" else 0)
        bucket = own if name in OWN else run
        bucket.extend(argv[i : i + 1 + takes])
        i += 1 + takes
    return own, run, []


def _writable(parser: argparse.ArgumentParser, path: str, what: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"{what} {path!r} is a directory: give a file path")
    if not os.path.isdir(folder):
        parser.error(f"{what} {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        parser.error(f"{what} {path!r} is not writable")


def _under_launcher(environ: dict[str, str] | os._Environ[str]) -> bool:
    if any(environ.get(var) not in (None, "", "0") for var in ("RANK", "LOCAL_RANK", "ACCELERATE_PROCESS_INDEX")):
        return True
    return environ.get("WORLD_SIZE", "1") not in ("", "1")


def parse(argv: list[str], environ: dict[str, str] | None = None) -> CompareRequest:
    """Parse and check everything before anything runs; bad input exits with status 2 and a message."""
    from . import launch

    environ = dict(os.environ if environ is None else environ)
    parser = build_parser()
    own, run, target = _split(argv)
    ns = parser.parse_args(own)
    if _under_launcher(environ):
        parser.error(
            "run leantrain compare once, outside torchrun / accelerate launch: it starts its own runs (a target "
            "that runs `accelerate launch` is measured on rank 0: leantrain compare accelerate launch ... train.py)"
        )
    if not target:
        parser.error("missing TARGET: a Python file, -m MODULE or an installed console script such as trl")
    if ns.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {ns.warmup}")
    if ns.steps < ns.warmup + 2:
        parser.error(
            f"--steps {ns.steps} leaves fewer than 2 timed steps after --warmup {ns.warmup}: give --steps >= "
            f"{ns.warmup + 2}"
        )
    head = target[0] if target[0] != "-m" else (target[1] if len(target) > 1 else "")
    head = head[2:] if head.startswith("-m") and len(head) > 2 else head
    if os.path.basename(head) in NOT_FOLLOWED:
        parser.error(
            f"{head} starts its workers as plain python processes, which leantrain compare cannot measure: "
            "compare under accelerate launch instead (leantrain compare accelerate launch --num_processes N "
            "train.py ...: rank 0's timings)"
        )
    for path, what in ((ns.json, "--json"), (ns.plot, "--plot")):
        _writable(parser, path, what)
    if ns.keep:
        _writable(parser, _keep.KEEP_FILE, "--keep:")
    if any(token.startswith("--measure") for token in run):
        parser.error("--measure is leantrain compare's own internal option")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            request = launch.parse([*run, "--", *target], environ)
    except SystemExit:  # leantrain run's parser said why: say it as compare
        message = errors.getvalue().strip().splitlines()
        parser.error(message[-1].split("error: ", 1)[-1] if message else "bad leantrain run options")
    return CompareRequest(ns.steps, ns.warmup, ns.json, ns.plot, ns.keep, tuple(run), tuple(target), request.options)


# --- running the four runs -----------------------------------------------------------------------------------------


class Progress:
    """``[2/4] leantrain: step 3 of 10`` while the runs go: updated in place on a terminal, one line per step
    elsewhere."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last = ""

    def show(self, text: str) -> None:
        if text == self.last:
            return
        self.last = text
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()
        self.last = ""


def _read_progress(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().split()
    except OSError:
        return 0
    return int(lines[-2]) if len(lines) >= 2 else 0


def _child_command(req: CompareRequest, mode: str, spec_path: str) -> list[str]:
    options = list(req.run_options) if mode == "leantrain" else []
    return [sys.executable, "-m", "leantrain", "run", *options, OPTION + spec_path, "--", *req.target]


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return ""


class RunFailed(Exception):
    pass


def run_one(
    req: CompareRequest,
    index: int,
    mode: str,
    workdir: str,
    progress: Progress,
    environ: dict[str, str],
    sleep_ms: float = 0.0,
) -> tuple[Measurement, float]:
    """One run in its own process; returns its Measurement and its wall time in seconds."""
    label = f"{mode} {1 + sum(m == mode for m in ORDER[:index])}"
    spec = MeasureSpec(
        steps=req.steps,
        out=os.path.join(workdir, f"run{index + 1}.json"),
        label=label,
        mode=mode,
        progress=os.path.join(workdir, f"run{index + 1}.progress"),
        completions="record" if index == 0 else "replay",
        completions_path=os.path.join(workdir, "completions.pt"),
        sleep_ms=sleep_ms,
    )
    spec_path = os.path.join(workdir, f"run{index + 1}.spec.json")
    spec.save(spec_path)
    env = dict(environ)
    if mode == "stock":
        env[LeantrainConfig.env_name("disable")] = "1"
    log_path = os.path.join(workdir, f"run{index + 1}-{mode}.log")
    head = f"[{index + 1}/{len(ORDER)}] {mode}"
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        child = subprocess.Popen(_child_command(req, mode, spec_path), stdout=log, stderr=subprocess.STDOUT, env=env)
        progress.show(f"{head}: starting")
        while child.poll() is None:
            done = _read_progress(spec.progress or "")
            if done:
                progress.show(f"{head}: step {done} of {req.steps}")
            time.sleep(0.2)
    wall = time.perf_counter() - start
    if child.returncode != 0:
        progress.done(f"{head}: failed (exit {child.returncode})")
        raise RunFailed(
            f"the {label} run failed (exit {child.returncode}); its output is in {log_path}; last lines:\n"
            + _tail(log_path)
        )
    if not os.path.exists(spec.out):
        progress.done(f"{head}: no trainer was measured")
        raise RunFailed(
            f"the {label} run finished without training in a process leantrain compare follows: the target must "
            "call Trainer.train() (TRL trainers included) in its own process or under an in-process `accelerate "
            f"launch`; its output is in {log_path}"
        )
    result = Measurement.load(spec.out)
    timed = result.step_ms[req.warmup :]
    median = _median(timed) if timed else float("nan")
    progress.done(f"{head}: {len(result.step_ms)} steps, median {median:.1f} ms after warm-up ({wall:.0f} s)")
    return result, wall


def run_all(
    req: CompareRequest,
    progress: Progress | None = None,
    environ: dict[str, str] | None = None,
    sleep_ms: dict[str, float] | None = None,
) -> tuple[list[Measurement], list[float]]:
    """The four runs in ORDER. ``sleep_ms`` (tests) injects a sleep into every step of a mode's runs."""
    progress = progress or Progress()
    environ = dict(os.environ if environ is None else environ)
    workdir = tempfile.mkdtemp(prefix="leantrain-compare-")
    runs, walls = [], []
    try:
        for index, mode in enumerate(ORDER):
            result, wall = run_one(req, index, mode, workdir, progress, environ, (sleep_ms or {}).get(mode, 0.0))
            runs.append(result)
            walls.append(wall)
    except BaseException:
        print(f"leantrain compare: the runs' files are kept in {workdir}", file=sys.stderr)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    return runs, walls


# --- statistics and the verdict ------------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def timing(runs: Sequence[Sequence[float]], warmup: int) -> dict[str, Any]:
    """One mode's step times after warm-up: pooled median and p20/p80, and each run's median."""
    pooled = [t for run in runs for t in run[warmup:]]
    return {
        "median_ms": _median(pooled),
        "p20_ms": quantile(pooled, 0.2),
        "p80_ms": quantile(pooled, 0.8),
        "run_medians_ms": [_median(run[warmup:]) for run in runs],
        "timed_steps": len(pooled),
    }


def speed_verdict(stock: dict[str, Any], lean: dict[str, Any]) -> dict[str, Any]:
    """A speed claim needs both: the two modes' p20-p80 intervals (pooled over both runs of each) do not overlap,
    and every run of the faster mode has a lower median than every run of the other. Anything else is within
    noise; ``ratio`` is stock's median over leantrain's either way."""
    ratio = stock["median_ms"] / lean["median_ms"] if lean["median_ms"] > 0 else float("nan")
    # the ratio's spread: the slowest stock step of the p20-p80 band over the fastest leantrain one, and back
    spread = [stock["p20_ms"] / lean["p80_ms"], stock["p80_ms"] / lean["p20_ms"]] if lean["p20_ms"] > 0 else None
    if lean["p80_ms"] < stock["p20_ms"] and max(lean["run_medians_ms"]) < min(stock["run_medians_ms"]):
        verdict = "faster"
    elif stock["p80_ms"] < lean["p20_ms"] and max(stock["run_medians_ms"]) < min(lean["run_medians_ms"]):
        verdict = "slower"
    else:
        verdict = "within noise"
    return {"verdict": verdict, "ratio": ratio, "ratio_p20_p80": spread}


def memory_verdict(stock_peaks: Sequence[int | None], lean_peaks: Sequence[int | None]) -> dict[str, Any]:
    """ "leaner" / "heavier" when every run of one mode peaks more than 1% below every run of the other."""
    if any(p is None for p in (*stock_peaks, *lean_peaks)) or not stock_peaks or not lean_peaks:
        return {"verdict": "not measured", "ratio": None}
    ratio = max(lean_peaks) / min(stock_peaks) if min(stock_peaks) else None  # type: ignore[type-var, operator]
    if max(lean_peaks) < (1 - LEANER) * min(stock_peaks):  # type: ignore[type-var, operator]
        verdict = "leaner"
    elif min(lean_peaks) > (1 + LEANER) * max(stock_peaks):  # type: ignore[type-var, operator]
        verdict = "heavier"
    else:
        verdict = "same"
    return {"verdict": verdict, "ratio": ratio}


def loss_bounds(stock: Sequence[float | None], dtype: str, layers: int | None) -> list[float | None]:
    """Per step: 8·u·√(2L+2)·(|loss_k| + Σ_{j<=k} |loss_j - loss_{j-1}|), from stock's losses.

    The first term is the parity suite's bound on one forward whose roundings differ (the CUDA CGGR test's
    8·u·√(2L+2): u the dtype's unit roundoff, 2L+2 the roundings a loss passes through in L layers, each summed in
    another order, as independent errors). The second carries it along the run: Adam's update is scale-free, so a
    relative gradient error maps to a relative update error of the same order, and the loss's movement since step 1
    (its total variation) can differ by that relative amount."""
    u = UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["bf16"])
    rel = 8 * u * math.sqrt(2 * (layers or LAYERS_UNKNOWN) + 2)
    bounds: list[float | None] = []
    moved, previous = 0.0, None
    for loss in stock:
        if loss is None or not math.isfinite(loss):
            bounds.append(None)
            continue
        if previous is not None:
            moved += abs(loss - previous)
        previous = loss
        bounds.append(rel * (abs(loss) + moved))
    return bounds


def _pairs_diff(a_runs: Sequence[Sequence[float | None]], b_runs: Sequence[Sequence[float | None]], k: int) -> float:
    values = [a[k] for a in a_runs if k < len(a)], [b[k] for b in b_runs if k < len(b)]
    diffs = [abs(x - y) for x in values[0] for y in values[1] if x is not None and y is not None]
    return max(diffs) if diffs else float("nan")


def loss_check(
    stock: Sequence[Sequence[float | None]],
    lean: Sequence[Sequence[float | None]],
    dtype: str,
    layers: int | None,
) -> dict[str, Any]:
    """Per step: the largest |stock - leantrain| over the run pairs against the bound; the bound also holds each
    mode's own run-to-run spread twice (a nondeterministic stack: stock differs from stock by that much)."""
    steps = min(len(run) for run in (*stock, *lean))
    derived = loss_bounds(stock[0][:steps], dtype, layers)
    diffs, bounds, spread = [], [], 0.0
    split = None
    for k in range(steps):
        own = [_pairs_diff(stock[:1], stock[1:], k), _pairs_diff(lean[:1], lean[1:], k)]
        spread = max([spread, *(d for d in own if math.isfinite(d))])
        diff = _pairs_diff(stock, lean, k)
        bound = None if derived[k] is None else derived[k] + 2 * spread  # type: ignore[operator]
        diffs.append(diff if math.isfinite(diff) else None)
        bounds.append(bound)
        if split is None and bound is not None and math.isfinite(diff) and diff > bound:
            split = k + 1
    compared = sum(d is not None and b is not None for d, b in zip(diffs, bounds))
    return {
        "diff": diffs,
        "bound": bounds,
        "split_step": split,  # the first step (1-based) past the bound
        "compared_steps": compared,
        "same": split is None and compared > 0,
        "rule": f"8·u·√(2L+2)·(|loss| + Σ|Δloss|) + 2·(run-to-run spread), u = {_u_text(dtype)}, "
        f"L = {layers if layers else f'{LAYERS_UNKNOWN} (assumed)'}",
    }


def _u_text(dtype: str) -> str:
    exponent = {"fp32": 24, "bf16": 8, "fp16": 11}.get(dtype, 8)
    return f"2^-{exponent} ({dtype})"


def agreement(stock: Sequence[Measurement], lean: Sequence[Measurement]) -> dict[str, dict[str, Any]]:
    """The loss, and each of CHECKED_METRICS that every run logged, per step against its bound (loss_check)."""
    dtype, layers = lean[0].dtype, lean[0].layers
    checks = {"loss": loss_check([r.losses for r in stock], [r.losses for r in lean], dtype, layers)}
    for name in CHECKED_METRICS:
        if all(r.metrics.get(name) for r in (*stock, *lean)):
            values = [[r.metrics[name] for r in runs] for runs in (stock, lean)]
            checks[name] = loss_check(values[0], values[1], dtype, layers)
    return checks


def verdict(runs: Sequence[Measurement], warmup: int) -> dict[str, Any]:
    """Everything the comparison concludes, from the four runs (ORDER)."""
    by_mode = {m: [r for r, o in zip(runs, ORDER) if o == m] for m in MODES}
    stock, lean = by_mode["stock"], by_mode["leantrain"]
    times = {m: timing([r.step_ms for r in by_mode[m]], warmup) for m in MODES}
    speed = speed_verdict(times["stock"], times["leantrain"])
    memory = memory_verdict([r.peak_bytes for r in stock], [r.peak_bytes for r in lean])
    checks = agreement(stock, lean)
    parts = [(c["split_step"], name != "loss", name) for name, c in checks.items() if c["split_step"]]
    split = min(parts, default=None)  # the first step past a bound; the loss first among metrics of that step
    applied = sorted(set(lean[0].applied) | set(lean[1].applied))
    changes_math = sorted(set(lean[0].changes_math))
    stock_applied = sorted({name for r in stock for name in r.applied})
    claims = [_speed_text(speed)] if speed["verdict"] != "within noise" else []
    if memory["verdict"] == "leaner":
        claims.append(f"{(1 - memory['ratio']) * 100:.0f}% less peak memory")
    elif memory["verdict"] == "heavier":
        claims.append(f"{(memory['ratio'] - 1) * 100:.0f}% more peak memory")
    if claims and speed["verdict"] == "within noise":
        claims.insert(0, "step time within noise")
    if stock_applied:
        text = (
            f"no claim: the stock runs applied {', '.join(stock_applied)} despite the kill switch (the script "
            "asks for it in code, which overrides LEANTRAIN_DISABLE=1)"
        )
    elif changes_math:
        what = ", ".join(changes_math)
        head = ", ".join(claims) if claims else "within noise: no claim"
        text = f"{head} (losses not compared: {what} changes the training math by design)"
    elif split:  # even with nothing applied: then the runs are not the same training
        what = "losses differ" if split[2] == "loss" else f"{split[2]} differs"
        text = f"{what} from step {split[0]}: no claim"
    elif not applied:
        text = "nothing applied: no claim"
    elif not checks["loss"]["same"]:
        text = "losses not logged: no claim"
    elif claims:
        text = f"{', '.join(claims)}, same losses"
    else:
        text = "within noise: no claim"
    helped = claims and speed["verdict"] != "slower" and memory["verdict"] != "heavier"
    return {
        "text": text,
        "applied": applied,
        "changes_math": changes_math,
        "speed": {**speed, **{m: times[m] for m in MODES}},
        "memory": memory,
        "losses": checks["loss"],
        "metrics": {name: c for name, c in checks.items() if name != "loss"},
        "helped": bool(applied and not stock_applied and helped and (split is None or changes_math)),
    }


def _speed_text(speed: dict[str, Any]) -> str:
    if speed["verdict"] == "faster":
        return f"faster by {speed['ratio']:.2f}x"
    if speed["verdict"] == "slower":
        return f"slower by {1 / speed['ratio']:.2f}x"
    return "within noise"


# --- output --------------------------------------------------------------------------------------------------------


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None or not math.isfinite(value) else format(value, spec)


def _loss(value: float | None) -> str:
    """Six decimals, or three significant digits for a loss near 0 (GRPO's)."""
    return _fmt(value, ".6f" if value is None or not math.isfinite(value) or abs(value) >= 1e-3 else ".3e")


def tokens_per_s(runs: Sequence[Measurement], warmup: int) -> float | None:
    tokens = [t for r in runs for t in r.tokens[warmup:]]
    ms = [t for r in runs for t in r.step_ms[warmup:]]
    if not tokens or any(t is None for t in tokens) or not sum(ms):
        return None
    return sum(tokens) / (sum(ms) / 1e3)  # type: ignore[arg-type]


def report_text(runs: Sequence[Measurement]) -> str:
    from .report import PatchOutcome, PatchReport, Status

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


def table(
    runs: Sequence[Measurement], result: dict[str, Any], warmup: int, extra: Sequence[tuple[str, str, str]] = ()
) -> str:
    """Side by side: step time, peak memory, tokens/s, losses (and ``extra`` rows), then the ratio's spread."""
    by_mode = {m: [r for r, o in zip(runs, ORDER) if o == m] for m in MODES}
    speed = result["speed"]
    kind = runs[0].peak_kind or "peak memory"

    def per_run(values: Sequence[float | None], spec: str) -> str:
        return " / ".join(_fmt(v, spec) for v in values)

    rows = [
        ("", "stock", "leantrain"),
        ("step time, median (ms)", *(_fmt(speed[m]["median_ms"], ".1f") for m in MODES)),
        ("step time, p20-p80 (ms)", *(f"{speed[m]['p20_ms']:.1f}-{speed[m]['p80_ms']:.1f}" for m in MODES)),
        ("median of each run (ms)", *(per_run(speed[m]["run_medians_ms"], ".1f") for m in MODES)),
        (f"{kind} (MiB)", *(" / ".join(_mib(r.peak_bytes) for r in by_mode[m]) for m in MODES)),
        ("tokens/s", *(_fmt(tokens_per_s(by_mode[m], warmup), ",.0f") for m in MODES)),
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
            f"stock / leantrain step time: {speed['ratio']:.2f}x at the medians, {band[0]:.2f}-{band[1]:.2f}x "
            "across the two p20-p80 bands"
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


def summary(req: CompareRequest, runs: Sequence[Measurement], walls: Sequence[float], result: dict[str, Any]) -> dict:
    """compare.json: the request, both modes (per run: step_ms, peak_bytes, losses, tokens, report) and the verdict."""
    by_mode = {m: [r for r, o in zip(runs, ORDER) if o == m] for m in MODES}
    modes = {
        m: {
            "step_ms": [r.step_ms for r in by_mode[m]],
            "peak_bytes": [r.peak_bytes for r in by_mode[m]],
            "peak_kind": by_mode[m][0].peak_kind,
            "losses": [r.losses for r in by_mode[m]],
            "tokens": [r.tokens for r in by_mode[m]],
            "tokens_source": by_mode[m][0].tokens_source,
            "tokens_per_s": tokens_per_s(by_mode[m], req.warmup),
            "metrics": [r.metrics for r in by_mode[m]],
            "report": by_mode[m][0].report,
            "applied": by_mode[m][0].applied,
        }
        for m in MODES
    }
    first = runs[0]
    return {
        "target": list(req.target),
        "run_options": list(req.run_options),
        "steps": req.steps,
        "warmup": req.warmup,
        "order": list(ORDER),
        "device": first.device,
        "dtype": runs[1].dtype,
        "layers": runs[1].layers,
        "world_size": first.world_size,
        "completions": "replayed from the first stock run" if runs[1].completions == "replay" else None,
        "run_wall_s": list(walls),
        **modes,
        "verdict": result,
    }


def plot(runs: Sequence[Measurement], result: dict[str, Any], warmup: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = {"stock": "tab:blue", "leantrain": "tab:orange"}
    for index, (run, mode) in enumerate(zip(runs, ORDER)):
        points = [(s, v) for s, v in zip(run.steps, run.losses) if v is not None]
        if points:
            xs, ys = zip(*points)
            style = {"linewidth": 3, "alpha": 0.45} if mode == "stock" else {"linestyle": "--", "linewidth": 1.5}
            left.plot(xs, ys, color=colors[mode], label=f"{index + 1}: {run.label or mode}", **style)
    left.set_xlabel("optimizer step")
    left.set_ylabel("training loss")
    left.set_title(f"losses: {result['losses']['rule']}", fontsize=8)
    left.legend(fontsize=8)
    data = [run.step_ms[warmup:] for run in runs]
    box = right.boxplot(data, whis=(0, 100), widths=0.5, patch_artist=True)
    for patch, mode in zip(box["boxes"], ORDER):
        patch.set_facecolor(colors[mode])
        patch.set_alpha(0.4)
    for index, run in enumerate(runs):
        right.scatter([index + 1] * len(run.step_ms[warmup:]), run.step_ms[warmup:], s=10, color="black", zorder=3)
        if warmup:
            right.scatter([index + 1] * warmup, run.step_ms[:warmup], s=14, marker="x", color="grey", zorder=3)
    right.set_xticks(range(1, len(runs) + 1), [f"{i + 1}: {r.label}" for i, r in enumerate(runs)], fontsize=8)
    right.set_ylabel("step time (ms)")
    right.set_title(f"step times after {warmup} warm-up steps (x: warm-up); {result['text']}", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def keep_decisions(req: CompareRequest, result: dict[str, Any]) -> dict[str, Any]:
    """For each optimization the leantrain runs applied: auto (True for an opt-in one or one the command line
    required) when the run helped, False when it did not. The applied set is measured as a whole."""
    decisions: dict[str, Any] = {}
    for name in result["applied"]:
        if result["helped"]:
            asked = req.options.get(name) is True or name in result["changes_math"]
            decisions[name] = True if asked else None
        else:
            decisions[name] = False
    return decisions


# --- the command ---------------------------------------------------------------------------------------------------


def compare(
    req: CompareRequest,
    out: Callable[[str], None] = print,
    environ: dict[str, str] | None = None,
    sleep_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Run the four runs, print the comparison, write the JSON, the PNG and (--keep) leantrain.json."""
    started = time.perf_counter()
    out(
        f"leantrain compare: {' '.join(req.target)}\n{req.steps} steps per run, the first {req.warmup} not timed; "
        f"runs in this order: {', '.join(ORDER)}"
    )
    runs, walls = run_all(req, environ=environ, sleep_ms=sleep_ms)
    result = verdict(runs, req.warmup)
    data = summary(req, runs, walls, result)
    lean = runs[1]
    where = f"{lean.device}, {lean.dtype}"
    if lean.world_size > 1:
        where += f", {lean.world_size} processes (rank 0's timings)"
    out("\n== what leantrain applied (the leantrain runs' patch report) ==\n" + report_text(runs))
    if data["completions"]:
        out("\nGRPO / RLOO: every run trained on the completions the first stock run sampled (each run still samples)")
    out(f"\n== measured ({where}; {len(runs) // 2} runs per mode) ==\n" + table(runs, result, req.warmup))
    out(f"\n== losses per step ({result['losses']['rule']}) ==\n" + loss_table(runs, result))
    for line in metric_lines(result):
        out(line)
    out(f"\nverdict: {result['text']}")
    with open(req.json_path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
    plot(runs, result, req.warmup, req.plot_path, f"leantrain compare: {' '.join(req.target)}"[:120])
    out(f"\nnumbers: {req.json_path}\nplot:    {req.plot_path}")
    if req.keep:
        decisions = keep_decisions(req, result)
        _keep.write(decisions, {"verdict": result["text"], "target": list(req.target), "json": req.json_path})
        listed = ", ".join(f"{n}={'auto' if v is None else v}" for n, v in decisions.items()) or "nothing applied"
        out(f"kept in ./{_keep.KEEP_FILE} for leantrain run: {listed}")
    total = time.perf_counter() - started
    out(f"({total:.0f} s in all; the four runs {sum(walls):.0f} s)")
    return data


def main(argv: list[str] | None = None) -> int:
    req = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        compare(req)
    except RunFailed as error:
        print(f"leantrain compare: error: {error}", file=sys.stderr)
        return 1
    return 0
