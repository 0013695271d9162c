"""Starting ``leantrain compare``'s four runs, each in its own process under ``leantrain run --measure``, with a
progress line while they go."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from ..config import LeantrainConfig
from ._measure import OPTION, Measurement, MeasureSpec
from .verdict import ORDER, median, steady_state


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


# A rank's own last words: under a launcher the log ends in the launcher's traceback, which names only the signal.
_CAUSE = re.compile(r"terminate called|Segmentation fault|Killed|(?<!ChildFailed)Error\b|Exception\b")
_LAUNCHER = ("torch/distributed/elastic", "torch/distributed/run.py", "ChildFailedError", "launcher/api.py")


def _tail(path: str, lines: int = 25) -> str:
    """The log's last lines; when a rank's error line sits above them (the launcher's report fills the tail), that
    line first, so the cause is in the message."""
    every = _lines(path)
    tail = every[-lines:]
    cause = _cause(every[: max(0, len(every) - lines)])
    return (f"first error above these lines: {cause}\n" if cause else "") + "".join(tail)


def _lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.readlines()
    except OSError:
        return []


def _cause(lines: list[str]) -> str:
    """The last line of ``lines`` that names a rank's own error (not the launcher's report), or ""."""
    causes = [line for line in lines if _CAUSE.search(line) and not any(m in line for m in _LAUNCHER)]
    return causes[-1].strip() if causes else ""


class RunFailed(Exception):
    pass


def _kept_log(log_path: str, req: CompareRequest) -> str:
    """Where the failed run's output can be read once the temporary folder is gone: the log copied beside the
    comparison's JSON (the folder compare writes its results to)."""
    folder = os.path.dirname(os.path.abspath(req.json_path))
    kept = os.path.join(folder, os.path.basename(log_path))
    try:
        os.makedirs(folder, exist_ok=True)
        shutil.copyfile(log_path, kept)
    except OSError as error:
        return f"its output could not be kept ({error})"
    return f"its output is in {kept}"


def _stop(child: subprocess.Popen) -> None:
    """End a run that is still going (compare was interrupted): it must not train on, nor write into the folder
    being removed."""
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


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
        try:
            progress.show(f"{head}: starting")
            while child.poll() is None:
                done = _read_progress(spec.progress or "")
                if done:
                    progress.show(f"{head}: step {done} of {req.steps}")
                time.sleep(0.2)
        finally:  # Ctrl-C or any error here: the run goes with compare
            _stop(child)
    wall = time.perf_counter() - start
    measured = os.path.exists(spec.out)  # written once every step was measured, before training is stopped
    if child.returncode != 0 and not measured:
        progress.done(f"{head}: failed (exit {child.returncode})")
        raise RunFailed(
            f"the {label} run failed (exit {child.returncode}); {_kept_log(log_path, req)}; last lines:\n"
            + _tail(log_path)
        )
    exit_note = ""
    if child.returncode != 0:  # e.g. a rank aborting in a library's teardown: the steps were measured, keep them
        cause = _cause(_lines(log_path)) or "no cause printed"
        exit_note = f"exited {child.returncode} after its steps were measured ({cause}); {_kept_log(log_path, req)}"
    if not measured:
        progress.done(f"{head}: no trainer was measured")
        raise RunFailed(
            f"the {label} run finished without training in a process leantrain compare follows: the target must "
            "call Trainer.train() (TRL trainers included) in its own process or under an in-process `accelerate "
            f"launch`; {_kept_log(log_path, req)}"
        )
    result = Measurement.load(spec.out)
    result.exit_note = exit_note
    cut = steady_state(result.step_ms, req.warmup).cut  # this run's own steady state, as the verdict times it
    timed = result.step_ms[cut:]
    middle = median(timed) if timed else float("nan")
    note = f"; {exit_note}" if exit_note else ""
    progress.done(
        f"{head}: {len(result.step_ms)} steps, median {middle:.1f} ms from step {cut + 1} on ({wall:.0f} s){note}"
    )
    return result, wall


def run_all(
    req: CompareRequest,
    progress: Progress | None = None,
    environ: dict[str, str] | None = None,
    sleep_ms: dict[str, float] | None = None,
) -> tuple[list[Measurement], list[float]]:
    """The four runs in ORDER; after the first leantrain run, none more when it applied nothing (the rest would
    only say so again). ``sleep_ms`` (tests) injects a sleep into every step of a mode's runs (key "stock") or of
    one run (key "stock 2": a neighbour that slows one run)."""
    progress = progress or Progress()
    environ = dict(os.environ if environ is None else environ)
    workdir = tempfile.mkdtemp(prefix="leantrain-compare-")
    runs, walls = [], []
    try:  # the runs' specs, logs and recorded completions go with the folder however compare ends
        for index, mode in enumerate(ORDER):
            sleep = sleep_ms or {}
            label = f"{mode} {1 + ORDER[:index].count(mode)}"
            result, wall = run_one(req, index, mode, workdir, progress, environ, sleep.get(label, sleep.get(mode, 0)))
            runs.append(result)
            walls.append(wall)
            if mode == "leantrain" and not result.applied:
                break
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return runs, walls
