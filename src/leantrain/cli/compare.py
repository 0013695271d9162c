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

Then it prints, side by side: the patch report, step time (median and p20-p80 over each run's steps from its steady
state on, detected from its own step times, or after ``--warmup W`` steps of every run), peak memory (CUDA max
allocated, or the process's peak RSS on CPU), tokens/s and the per-step losses against a bound derived from the
dtype's rounding; and a verdict (``verdict``): "faster by x" (or slower, or leaner) with "same losses", "within
noise: no claim", "no claim: <the cause>" (a run that had not settled, same-mode runs that disagree, a loaded host,
too few timed steps), "losses differ from step k", or "nothing applied: no claim" (then after the first leantrain
run). It writes
the numbers to ``--json`` and loss curves and step-time distributions to ``--plot`` (both under
``./leantrain-compare/`` by default); ``--keep`` writes what a claim said into ``./leantrain.json`` for the same
target, which ``leantrain run`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config import resolve_config
from . import _keep
from ._measure import Measurement
from .plot import plot
from .printing import loss_table, metric_lines, report_text, table
from .runs import CompareRequest, RunFailed, run_all
from .verdict import MIN_STEPS, MIN_TIMED, MODES, ORDER, cuts_by_mode, rule_text, tokens_per_s, verdict


USAGE = (
    "leantrain compare [--steps N] [--warmup W] [--json PATH] [--plot PATH] [--keep] [run options] "
    "(FILE | -m MODULE | CONSOLE_SCRIPT) [ARGS ...]"
)
# compare's own options and how many values each takes; everything else before the target is leantrain run's
OWN = {"--steps": 1, "--warmup": 1, "--json": 1, "--plot": 1, "--keep": 0, "-h": 0, "--help": 0}
DEFAULT_DIR = "leantrain-compare"  # in the working directory, as leantrain demo writes leantrain-demo/
DEFAULT_JSON = os.path.join(DEFAULT_DIR, "compare.json")
DEFAULT_PLOT = os.path.join(DEFAULT_DIR, "compare.png")
NOT_FOLLOWED = ("torchrun", "torch.distributed.run", "deepspeed")  # start workers as plain python: not measured


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
    parser.add_argument(
        "--steps", type=int, default=10, help=f"optimizer steps per run (default 10, at least {MIN_STEPS})"
    )
    parser.add_argument(
        "--warmup",
        default="auto",
        metavar="W",
        help="auto (default): each run is timed from its own steady state, detected from its step times (MSER); "
        "W >= 0: the first W steps of every run are left out of the timing instead",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help=f"numbers (default {DEFAULT_JSON})")
    parser.add_argument("--plot", default=None, metavar="PATH", help=f"PNG (default {DEFAULT_PLOT})")
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
    """The file can be written once its missing folders are made (they are, when the numbers are written): refuse
    only what cannot be, a folder in the way that is a file or one that is not writable."""
    if os.path.isdir(path):
        parser.error(f"{what} {path!r} is a directory: give a file path")
    folder = existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        parser.error(f"{what} {path!r}: {existing!r} is a file, so the folder {folder!r} cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        made = "" if existing == folder else f" (the folder {folder!r} would be made there)"
        parser.error(f"{what} {path!r} is not writable: {existing!r} is not writable{made}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        parser.error(f"{what} {path!r} is not writable")


def _warmup(parser: argparse.ArgumentParser, text: str) -> int | None:
    """``auto`` (None: each run's steady state is detected) or a whole number of steps >= 0."""
    if text == "auto":
        return None
    try:
        warmup = int(text)
    except ValueError:
        warmup = -1
    if warmup < 0:
        parser.error(f"--warmup must be >= 0 or auto, got {text}")
    return warmup


def _check_steps(parser: argparse.ArgumentParser, steps: int, warmup: int | None) -> None:
    if warmup is None and steps < MIN_STEPS:
        parser.error(
            f"--steps must be >= {MIN_STEPS}, got {steps}: each run's steady state is detected by leaving out up to "
            f"half of its steps, and a speed claim needs {MIN_TIMED} timed steps a run"
        )
    if warmup is not None and steps < warmup + MIN_TIMED:
        parser.error(
            f"--steps {steps} leaves {max(steps - warmup, 0)} timed steps after --warmup {warmup}, and a speed claim "
            f"needs {MIN_TIMED}: give --steps >= {warmup + MIN_TIMED}"
        )


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
    ns.warmup = _warmup(parser, ns.warmup)
    _check_steps(parser, ns.steps, ns.warmup)
    head = target[0] if target[0] != "-m" else (target[1] if len(target) > 1 else "")
    head = head[2:] if head.startswith("-m") and len(head) > 2 else head
    if os.path.basename(head) in NOT_FOLLOWED:
        parser.error(
            f"{head} starts its workers as plain python processes, which leantrain compare cannot measure: "
            "compare under accelerate launch instead (leantrain compare accelerate launch --num_processes N "
            "train.py ...: rank 0's timings)"
        )
    ns.json = ns.json or DEFAULT_JSON
    ns.plot = ns.plot or DEFAULT_PLOT
    for path, what in ((ns.json, "--json"), (ns.plot, "--plot")):
        _writable(parser, path, what)  # missing folders are made when the runs are done
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


def summary(req: CompareRequest, runs: Sequence[Measurement], walls: Sequence[float], result: dict[str, Any]) -> dict:
    """compare.json: the request, both modes (per run: step_ms, peak_bytes, losses, tokens, report) and the verdict."""
    by_mode = {m: [r for r, o in zip(runs, ORDER) if o == m] for m in MODES}
    modes = {
        m: {
            "step_ms": [r.step_ms for r in by_mode[m]],
            "step_cpu_ms": [r.step_cpu_ms for r in by_mode[m]],  # this process's CPU time per step
            "host_load": [r.host_load for r in by_mode[m]],  # the host's 1-minute load average at each step's end
            "cores": by_mode[m][0].cores,
            "peak_bytes": [r.peak_bytes for r in by_mode[m]],
            "peak_kind": by_mode[m][0].peak_kind,
            "losses": [r.losses for r in by_mode[m]],
            "tokens": [r.tokens for r in by_mode[m]],
            "tokens_source": by_mode[m][0].tokens_source,
            "tokens_per_s": tokens_per_s(by_mode[m], cuts_by_mode(result)[m]),
            "metrics": [r.metrics for r in by_mode[m]],
            "report": by_mode[m][0].report,
            "applied": by_mode[m][0].applied,
            "exit_notes": [r.exit_note for r in by_mode[m]],  # a run that exited with an error once measured
        }
        for m in MODES
    }
    first = runs[0]
    return {
        "target": list(req.target),
        "run_options": list(req.run_options),
        "steps": req.steps,
        "warmup": "auto" if req.warmup is None else req.warmup,  # each run's cut and the rule: verdict.steady
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


# --- the command ---------------------------------------------------------------------------------------------------


def warmup_warning(req: CompareRequest, applied: Sequence[str], environ: dict[str, str] | None) -> str | None:
    """CGGR trains every token for its first ``cggr_warmup_steps``: steps measured inside that window time the
    warm-up, not CGGR."""
    if "cggr" not in applied:
        return None
    warm = resolve_config({}, os.environ if environ is None else environ, cli=req.options).config.cggr_warmup_steps
    if req.steps > warm:
        return None
    return (
        f"warning: all {req.steps} measured steps fall inside CGGR's warm-up ({warm} steps that train every token), "
        "so this measures the warm-up, not CGGR; to measure CGGR itself, shorten it for the comparison: "
        "--opt cggr_warmup_steps=0"
    )


def _nothing_applied(req: CompareRequest, runs: Sequence[Measurement], walls: Sequence[float], out) -> dict:
    """The first leantrain run applied nothing: the other two runs could only say so again."""
    text = "nothing applied: no claim (stopped after the first leantrain run: the other runs would train the same)"
    result = {"text": text, "applied": [], "changes_math": [], "helped": False, "keep": None, "stopped_early": True}
    lean = runs[-1]
    where = f"{lean.device}, {lean.dtype}" + (
        f", {lean.world_size} processes (rank 0's timings)" if lean.world_size > 1 else ""
    )
    out(f"\n== what leantrain applied (the leantrain run's patch report; {where}) ==\n" + report_text(runs))
    out(f"\nverdict: {text}")
    data = {"target": list(req.target), "steps": req.steps, "order": list(ORDER[: len(runs)]), "verdict": result}
    data.update(device=lean.device, dtype=lean.dtype, world_size=lean.world_size, run_wall_s=list(walls))
    for run, mode in zip(runs, ORDER):  # the runs measured before stopping, as in the full summary
        data[mode] = {"step_ms": [run.step_ms], "losses": [run.losses], "applied": run.applied}
    with open(req.json_path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
    out(f"\nnumbers: {req.json_path}")
    return data


def _keep_result(req: CompareRequest, result: dict[str, Any], out: Callable[[str], None]) -> None:
    decisions = _keep.decisions(req.options, result)
    if not decisions:
        out(f"nothing kept in ./{_keep.KEEP_FILE}: the verdict made no claim ({result['text']})")
        return
    _keep.write(decisions, {"verdict": result["text"], "target": list(req.target), "json": req.json_path})
    listed = ", ".join(f"{n}={'auto' if v is None else v}" for n, v in decisions.items())
    target = " ".join(_keep.target_key(req.target))
    out(f"kept in ./{_keep.KEEP_FILE} for leantrain run on {target} only: {listed}")


def compare(
    req: CompareRequest,
    out: Callable[[str], None] = print,
    environ: dict[str, str] | None = None,
    sleep_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Run the four runs, print the comparison, write the JSON, the PNG and (--keep) leantrain.json."""
    started = time.perf_counter()
    out(
        f"leantrain compare: {' '.join(req.target)}\n{req.steps} steps per run, {rule_text(req.warmup)}; "
        f"runs in this order: {', '.join(ORDER)}"
    )
    runs, walls = run_all(req, environ=environ, sleep_ms=sleep_ms)
    for path in (req.json_path, req.plot_path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if len(runs) < len(ORDER):
        return _nothing_applied(req, runs, walls, out)
    result = verdict(runs, req.warmup)
    data = summary(req, runs, walls, result)
    lean = runs[1]
    where = f"{lean.device}, {lean.dtype}"
    if lean.world_size > 1:
        where += f", {lean.world_size} processes (rank 0's timings)"
    out("\n== what leantrain applied (the leantrain runs' patch report) ==\n" + report_text(runs))
    if data["completions"]:
        out("\nGRPO / RLOO: every run trained on the completions the first stock run sampled (each run still samples)")
    out(f"\n== measured ({where}; {len(runs) // 2} runs per mode) ==\n" + table(runs, result))
    out(f"\n== losses per step ({result['losses']['rule']}) ==\n" + loss_table(runs, result))
    for line in metric_lines(result):
        out(line)
    for note in (result["capped"], warmup_warning(req, result["applied"], environ)):
        if note:
            out(note)
    out(f"\nverdict: {result['text']}")
    with open(req.json_path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
    plot(runs, result, req.plot_path, f"leantrain compare: {' '.join(req.target)}")
    out(f"\nnumbers: {req.json_path}\nplot:    {req.plot_path}")
    if req.keep:
        _keep_result(req, result, out)
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
