"""One training run, measured: the per-step clock, peak memory, losses and tokens behind ``leantrain compare`` and
``leantrain demo``.

``leantrain compare`` runs each mode as ``python -m leantrain run --measure=SPEC TARGET ...``: the hook that
``leantrain run`` installs on ``Trainer.train`` hands the first trainer that trains to :func:`measured_train`, which
caps the run at the spec's steps, logs every step, turns off evaluation, checkpoints, hub pushes and trackers (a
measurement writes nothing of the user's), times each optimizer step (CUDA-synchronized at both ends), keeps the
peak memory of the training loop, writes a :class:`Measurement` as JSON (rank 0) and ends the process: nothing the
script does after ``train()`` runs. The demo measures its in-process runs with the same :class:`StepMeter`.

GRPO and RLOO sample their completions: two runs whose weights differ in the last bit after one update sample
different completions from then on, and their losses part for that reason alone. With ``completions="record"`` a
run keeps what its generation returned, call by call; with ``"replay"`` a run still generates (its step time
includes generation) and then trains on the recorded completions instead, so stock and leantrain runs score the
same completions at every step and their losses compare what the optimizations change.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


OPTION = "--measure="  # leantrain run's internal option: one token, so run's own target split passes it through
# Trainer metrics kept per step besides the loss (when the trainer logs them): what the report and plot show.
KEPT_METRICS = ("grad_norm", "entropy", "reward", "kl", "num_tokens", "learning_rate")
GENERATION_METHOD = "_generate_single_turn"  # TRL's GRPO / RLOO: one sampling call -> (completion ids, ...)


class MeasureDone(BaseException):
    """Raised after the measured ``train()``: ends the child process (``leantrain run`` exits 0), so what the
    script does after training (saving, evaluating, pushing) does not run. A BaseException: a script's own
    ``except Exception`` does not swallow it."""


@dataclass
class MeasureSpec:
    """What one measured run does; written by ``leantrain compare`` as JSON, read by the child."""

    steps: int
    out: str  # where the child writes its Measurement (JSON)
    label: str = ""  # "stock 1", "leantrain 2", ...: for progress lines
    mode: str = "leantrain"  # "stock": the kill switch is on and ./leantrain.json is not read
    progress: str | None = None  # a file the child appends "k N" to after each optimizer step
    completions: str | None = None  # "record" or "replay" (GRPO / RLOO), with completions_path
    completions_path: str | None = None
    sleep_ms: float = 0.0  # tests only: a sleep inside every timed step (a forced slow path)

    @classmethod
    def load(cls, path: str) -> MeasureSpec:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(asdict(self), handle)


@dataclass
class Measurement:
    """One run: per optimizer step its wall time, loss, tokens and kept metrics; the run's peak memory and report."""

    label: str = ""
    steps: list[int] = field(default_factory=list)  # global step of each measured step
    step_ms: list[float] = field(default_factory=list)
    # per step: this process's CPU time (all its threads), and the host's 1-minute load average at the step's end:
    # what a busy machine does to the wall time shows up here and not there
    step_cpu_ms: list[float] = field(default_factory=list)
    host_load: list[float | None] = field(default_factory=list)
    cores: int = 1  # the CPUs this process may run on: the load is read against them
    losses: list[float | None] = field(default_factory=list)
    tokens: list[int | None] = field(default_factory=list)  # tokens trained in each step
    tokens_source: str = ""  # "trl num_tokens (all ranks)" or "input tokens (rank 0)"
    metrics: dict[str, list[float | None]] = field(default_factory=dict)
    peak_bytes: int | None = None
    peak_kind: str = ""  # "CUDA max allocated" or "peak RSS"
    report: dict[str, Any] | None = None  # PatchReport.to_dict()
    applied: list[str] = field(default_factory=list)
    changes_math: list[str] = field(default_factory=list)  # applied optimizations that are opt-in: math changes
    dtype: str = "fp32"  # the training compute dtype: bf16 / fp16 / fp32
    layers: int | None = None  # decoder layers of the model (the loss bound's rounding depth)
    device: str = "cpu"
    world_size: int = 1
    requested_steps: int = 0
    max_steps: int = 0  # what the script asked for (-1: epochs)
    completions: str | None = None  # "record" / "replay" when completions were recorded / replayed
    exit_note: str = ""  # set by compare where the process exited with an error after its steps were measured

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @classmethod
    def load(cls, path: str) -> Measurement:
        with open(path, encoding="utf-8") as handle:
            return cls.from_json(json.load(handle))


# --- the host ------------------------------------------------------------------------------------------------


def host_load() -> float | None:
    """The host's 1-minute load average (runnable threads, this process's included); None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# --- peak memory ------------------------------------------------------------------------------------------------


def _rss_high_water() -> int | None:
    """This process's peak resident memory since the last reset (Linux VmHWM), in bytes; None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            found = re.search(r"VmHWM:\s+(\d+)\s+kB", handle.read())
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def reset_peak_memory(cuda: bool) -> str:
    """Start a peak-memory window; returns what will be read: CUDA's max allocated, or the process's peak RSS
    (reset through /proc/self/clear_refs; where that is refused, the peak since the process started)."""
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return "CUDA max allocated"
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")  # resets VmHWM to the current RSS
        return "peak RSS"
    except OSError:
        return "peak RSS since start"


def peak_memory(cuda: bool) -> int | None:
    import torch

    if cuda:
        return int(torch.cuda.max_memory_allocated())
    found = _rss_high_water()
    if found is not None:
        return found
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _on_cuda(trainer: Any) -> bool:
    device = getattr(trainer.args, "device", None)
    return getattr(device, "type", "cpu") == "cuda"


# --- what the run is --------------------------------------------------------------------------------------------


def compute_dtype(trainer: Any) -> str:
    """bf16 / fp16 under mixed precision, else the dtype of the trained parameters."""
    import torch

    args = trainer.args
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    params = [p for p in trainer.model.parameters() if p.is_floating_point()]
    trained = [p for p in params if p.requires_grad] or params
    dtype = trained[0].dtype if trained else torch.float32
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def decoder_layers(trainer: Any) -> int | None:
    config = getattr(trainer.model, "config", None)
    value = getattr(config, "num_hidden_layers", None)
    return int(value) if isinstance(value, int) else None


def _math_changing(applied: list[str]) -> list[str]:
    from ..optimization import registry

    return [name for name, opt in registry().items() if name in applied and opt.off_by_default_why]


# --- the clock --------------------------------------------------------------------------------------------------


class StepMeter:
    """Per optimizer step: wall time (on_step_begin to on_step_end, CUDA-synchronized at both ends), loss, tokens,
    the kept metrics. ``install`` puts its begin before every other callback and its end after them, so the work
    other callbacks do in a step (leantrain's included) is inside the step's time."""

    def __init__(
        self,
        total: int,
        progress: Callable[[int, int, Measurement], None] | None = None,
        sleep_ms: float = 0.0,
    ) -> None:
        self.total, self.progress, self.sleep_ms = total, progress, sleep_ms
        self.result = Measurement()
        self._t0 = 0.0
        self._cpu0 = 0.0
        self._logs: dict[int, dict[str, float]] = {}
        self._inputs_tokens: Any = None  # a device tensor summed without a host sync; read at the step's end
        self._counted: list[int] = []
        self.cuda = False

    def _now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def install(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        meter = self
        self.cuda = _on_cuda(trainer)

        class Begin(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                meter.result.peak_kind = reset_peak_memory(meter.cuda)

            def on_step_begin(self, args, state, control, **kwargs):
                meter._inputs_tokens = None
                meter._t0 = meter._now()
                meter._cpu0 = time.process_time()
                if meter.sleep_ms:
                    time.sleep(meter.sleep_ms / 1e3)

        class End(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                meter._step_end(state.global_step)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs:
                    numeric = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}
                    meter._logs.setdefault(state.global_step, {}).update(numeric)

            def on_train_end(self, args, state, control, **kwargs):
                meter.result.peak_bytes = peak_memory(meter.cuda)

        trainer.callback_handler.callbacks.insert(0, Begin())
        trainer.add_callback(End())
        self._count_inputs(trainer)

    def _count_inputs(self, trainer: Any) -> None:
        """Tokens of each micro-batch that carries ``input_ids`` (non-padding where there is a mask), summed on the
        device; TRL's logged ``num_tokens`` replaces this count where it exists (GRPO's inputs are prompts)."""
        original = trainer.training_step

        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            self._add_tokens(inputs)
            return original(model, inputs, *args, **kwargs)

        trainer.training_step = training_step

    def _add_tokens(self, inputs: Any) -> None:
        import torch

        # a plain Trainer's collators return a BatchEncoding: a Mapping, not a dict
        if not isinstance(inputs, Mapping) or not torch.is_tensor(inputs.get("input_ids")):
            return
        mask = inputs.get("attention_mask")
        count = mask.sum() if torch.is_tensor(mask) else torch.tensor(inputs["input_ids"].numel())
        self._inputs_tokens = count if self._inputs_tokens is None else self._inputs_tokens + count

    def _step_end(self, step: int) -> None:
        self.result.step_ms.append((self._now() - self._t0) * 1e3)
        self.result.step_cpu_ms.append((time.process_time() - self._cpu0) * 1e3)
        self.result.host_load.append(host_load())
        self.result.steps.append(step)
        counted = self._inputs_tokens
        self._counted.append(int(counted.item()) if counted is not None else 0)
        if self.progress is not None:
            self.progress(len(self.result.step_ms), self.total, self.result)

    def finish(self) -> Measurement:
        """Align the logged values with the measured steps (a log belongs to the step it was written after)."""
        result = self.result
        result.losses = [self._logs.get(s, {}).get("loss") for s in result.steps]
        for key in KEPT_METRICS:
            values = [self._logs.get(s, {}).get(key) for s in result.steps]
            if any(v is not None for v in values):
                result.metrics[key] = values
        seen = result.metrics.get("num_tokens")
        if seen and all(v is not None for v in seen):
            previous = [0.0, *seen[:-1]]
            result.tokens = [int(round(a - b)) for a, b in zip(seen, previous)]
            result.tokens_source = "TRL num_tokens (all ranks)"
        elif any(self._counted):
            result.tokens = list(self._counted)
            result.tokens_source = "input tokens (rank 0)"
        else:
            result.tokens = [None] * len(result.steps)
        return result


# --- completions, recorded and replayed (GRPO / RLOO) -----------------------------------------------------------


class Completions:
    """Wraps the trainer's sampling call: ``record`` keeps each call's output, ``replay`` returns the recorded one
    (after sampling, so the step still pays for generation). Outputs are kept in memory and, with a path, saved
    with ``torch.save`` for other processes."""

    def __init__(self, mode: str, path: str | None = None, calls: list[Any] | None = None) -> None:
        if mode not in ("record", "replay"):
            raise ValueError(f"completions mode must be 'record' or 'replay', got {mode!r}")
        self.mode, self.path = mode, path
        self.calls: list[Any] = calls if calls is not None else []
        self.used = 0

    def install(self, trainer: Any) -> bool:
        """Wrap ``trainer``'s sampling call; False when the trainer has none (not GRPO / RLOO)."""
        original = getattr(trainer, GENERATION_METHOD, None)
        if original is None:
            return False
        if self.mode == "replay" and not self.calls and self.path:
            import torch

            self.calls = torch.load(self.path, weights_only=False)

        def generate(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if self.mode == "record":
                self.calls.append(out)
                return out
            if self.used >= len(self.calls):
                raise RuntimeError(
                    f"replaying completions: call {self.used + 1} but {len(self.calls)} were recorded (the runs "
                    "did not make the same sampling calls)"
                )
            recorded = self.calls[self.used]
            self.used += 1
            return recorded

        setattr(trainer, GENERATION_METHOD, generate)
        return True

    def save(self) -> None:
        if self.mode == "record" and self.path:
            import torch

            torch.save(self.calls, self.path)


# --- the measured train() of a compare child ----------------------------------------------------------------------


def spec_from_prefix(prefix: tuple[str, ...] | list[str]) -> MeasureSpec | None:
    """The spec named by a ``--measure=SPEC`` token among ``leantrain run``'s options, if any."""
    for token in prefix:
        if token.startswith(OPTION):
            return MeasureSpec.load(token[len(OPTION) :])
    return None


def _quiet_run(trainer: Any, steps: int) -> tuple[int, int]:
    """Cap the run at ``steps`` optimizer steps, log each step, and leave the user's files and trackers alone:
    no evaluation, no checkpoints, no hub pushes, no tracker callbacks. Returns (steps run, the script's max_steps)."""
    from transformers.trainer_utils import IntervalStrategy

    args = trainer.args
    asked = int(args.max_steps)
    args.max_steps = steps if asked <= 0 else min(steps, asked)
    args.logging_strategy = IntervalStrategy.STEPS
    args.logging_steps = 1
    args.eval_strategy = IntervalStrategy.NO
    args.load_best_model_at_end = False
    args.push_to_hub = False
    try:
        from transformers.trainer_utils import SaveStrategy

        args.save_strategy = SaveStrategy.NO
    except ImportError:  # older transformers: one enum for both
        args.save_strategy = IntervalStrategy.NO
    callbacks = trainer.callback_handler.callbacks
    callbacks[:] = [c for c in callbacks if not type(c).__module__.startswith("transformers.integrations")]
    return int(args.max_steps), asked


def _is_rank_zero(trainer: Any) -> bool:
    check = getattr(trainer, "is_world_process_zero", None)
    return bool(check()) if callable(check) else os.environ.get("RANK", "0") == "0"


def measure_run(
    trainer: Any,
    train: Callable[[], Any],
    steps: int,
    label: str = "",
    progress: Callable[[int, int, Measurement], None] | None = None,
    completions: Completions | None = None,
    sleep_ms: float = 0.0,
    report: Callable[[], Any] | None = None,
) -> Measurement:
    """Run ``train()`` on ``trainer`` capped at ``steps`` and measured; returns the Measurement."""
    run_steps, asked = _quiet_run(trainer, steps)
    meter = StepMeter(run_steps, progress, sleep_ms)
    meter.install(trainer)
    if completions is not None and not completions.install(trainer):
        completions = None
    train()
    result = meter.finish()
    current = report() if report is not None else None
    result.label = label
    result.report = current.to_dict() if current is not None else None
    result.applied = list(current.applied) if current is not None else []
    result.changes_math = _math_changing(result.applied)
    result.dtype, result.layers = compute_dtype(trainer), decoder_layers(trainer)
    result.device = "cuda" if meter.cuda else "cpu"
    result.world_size = int(getattr(trainer.args, "world_size", 1) or 1)
    result.requested_steps, result.max_steps = steps, asked
    result.cores = usable_cores()
    if completions is not None:
        completions.save()
        result.completions = completions.mode
    return result


def measured_train(spec: MeasureSpec) -> Callable[..., Any]:
    """The ``around`` hook of ``leantrain run --measure=SPEC``: measures the first trainer's ``train()``, writes the
    Measurement (rank 0) and raises :class:`MeasureDone`."""

    def around(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from ..entry import current_report

        rank0 = _is_rank_zero(trainer)
        completions = None
        if spec.completions:
            path = spec.completions_path
            rank = int(os.environ.get("RANK", "0") or 0)
            completions = Completions(spec.completions, f"{path}.rank{rank}" if path else None)

        def progress(k: int, n: int, _: Measurement) -> None:
            if rank0 and spec.progress:
                with open(spec.progress, "a", encoding="utf-8") as handle:
                    handle.write(f"{k} {n}\n")

        result = measure_run(
            trainer,
            lambda: original(trainer, *args, **kwargs),
            spec.steps,
            spec.label,
            progress,
            completions,
            spec.sleep_ms,
            lambda: current_report(trainer),
        )
        if rank0:
            tmp = spec.out + ".tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(result.to_json(), handle, default=_plain)
            os.replace(tmp, spec.out)
        sys.stdout.flush()
        raise MeasureDone()

    return around


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
