"""What is alive on the GPU at a training step's peak: a callback that records each step's peak allocated memory and,
for one chosen step, the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``), replayed
into the live blocks at the step's peak, grouped by the code that allocated them. On torch 2.11 a compiled region
inside an activation checkpoint fails (``SystemError`` from the compiled function's ``apply``) while the history
records (pytorch#179536): trace runs with eager layers there.

The replay (``live_at_peak``) is pure Python over the snapshot's trace events, so it is tested on CPU with made-up
traces; the callback needs CUDA. Benchmarks use it to say where a peak comes from (``--trace-peak`` in
bench_offload_checkpoints.py), not to time anything: recording stacks slows the traced step."""

from __future__ import annotations

import linecache
import os
from collections.abc import Callable, Iterable
from typing import Any


GIB = 1024**3
# Frames from these folders say little about who asked for the memory: the label is the first frame outside them.
PLUMBING = ("/torch/nn/modules/module.py", "/torch/_tensor.py", "/torch/autograd/", "/torch/utils/_contextlib.py",
            "/torch/_dynamo/", "/torch/_functorch/", "/torch/_ops.py", "/torch/overrides.py", "/torch/_compile.py",
            "/torch/_inductor/runtime/", "/torch/_inductor/utils.py", "/torch/_prims_common/",
            "/torch/_C/", "<frozen")  # fmt: skip


# Where the model's own code is: the frame that says which layer, projection or loss a compiled buffer serves.
MODEL_CODE = ("/transformers/models/", "/peft/tuners/", "/leantrain/")


def frame_label(frames: Iterable[dict[str, Any]]) -> str:
    """``file:line name`` of the innermost frame that is not torch's plumbing (module calls, autograd, dynamo), or
    ``(no python frame)`` (an allocation made from C++ alone, e.g. autograd's gradient accumulation). A frame of
    generated code (inductor's output files) also carries its source line, which names the buffer and its shape."""
    listed = list(frames)
    for frame in listed:
        name = str(frame.get("filename", ""))
        if not any(part in name for part in PLUMBING):
            label = f"{short_path(name)}:{frame.get('line', '?')} {frame.get('name', '?')}"
            if "torchinductor_" in name:
                label += " | " + linecache.getline(name, int(frame.get("line", 0) or 0)).strip()[:120]
            return label
    return "(no python frame)" if not listed else f"{short_path(str(listed[0].get('filename')))} (torch internals)"


def context_label(frames: Iterable[dict[str, Any]]) -> str:
    """``file:line name`` of the innermost frame in the model's code (transformers' modeling files, PEFT's tuners,
    leantrain), or ``(outside model code)``: for compiled code, the layer call or checkpoint recompute it runs in."""
    for frame in frames:
        name = str(frame.get("filename", ""))
        if any(part in name for part in MODEL_CODE):
            return f"{short_path(name)}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return "(outside model code)"


def short_path(path: str) -> str:
    """The path from its package down (``site-packages/`` and the like cut off)."""
    for marker in ("site-packages/", "/src/", "/benchmarks/", "torchinductor_"):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.basename(path)


def live_at_peak(
    events: Iterable[dict[str, Any]], start_bytes: int = 0, from_event: int = 0
) -> tuple[int, list[dict[str, Any]]]:
    """Replay one device's allocator trace from ``start_bytes`` allocated: the most bytes allocated at once from event
    ``from_event`` on (the events before it only build the state), and the traced blocks alive at that moment.

    A block counts from its ``alloc`` to its ``free_completed`` (the moment the allocator's statistics drop it: a
    block used on a side stream is freed only once that stream is done with it); traces without completed frees
    use ``free_requested``. A block allocated before the trace began is not listed, but its free lowers the total."""
    events = list(events)
    ends = "free_completed" if any(e.get("action") == "free_completed" for e in events) else "free_requested"
    live: dict[int, dict[str, Any]] = {}
    total = best = start_bytes
    best_live: list[dict[str, Any]] = []
    if from_event:
        best = -1
    for index, event in enumerate(events):
        action, size = event.get("action"), int(event.get("size", 0))
        if action == "alloc":
            live[event.get("addr")] = event
            total += size
            if total > best and index >= from_event:
                best, best_live = total, list(live.values())
        elif action == ends:
            live.pop(event.get("addr"), None)
            total -= size
    return best, best_live


def group_blocks(
    blocks: Iterable[dict[str, Any]], top: int = 20, label: Callable[[list[dict[str, Any]]], str] = frame_label
) -> list[dict[str, Any]]:
    """Live blocks grouped by ``label`` of their allocation's frames (``frame_label`` by default), largest total
    first: ``{"where", "gib", "blocks"}``; what is past ``top`` is one row, ``(others)``."""
    groups: dict[str, list[int]] = {}
    for block in blocks:
        entry = groups.setdefault(label(block.get("frames") or []), [0, 0])
        entry[0] += int(block.get("size", 0))
        entry[1] += 1
    rows = [{"where": k, "gib": round(v[0] / GIB, 4), "blocks": v[1]} for k, v in groups.items()]
    rows.sort(key=lambda r: -r["gib"])
    if len(rows) > top:
        rest = rows[top:]
        rows = [*rows[:top], {"where": "(others)", "gib": round(sum(r["gib"] for r in rest), 4),
                              "blocks": sum(r["blocks"] for r in rest)}]  # fmt: skip
    return rows


def step_peaks_callback(rec: dict[str, Any], trace_step: int | None = None) -> Any:
    """A TrainerCallback that appends each step's peak allocated GiB to ``rec["step_peaks_gib"]`` and, for step
    ``trace_step`` (1-based), stores the live blocks at that step's peak in ``rec["peak_trace"]``. The allocator's
    history is recorded from the start of training, so compiled code is built and run under the same recording
    (starting it mid-run changes the state compiled code was built in). Resetting the peak statistic at each step
    leaves the run's peak as the largest step's."""
    import torch
    from transformers import TrainerCallback

    class StepPeaks(TrainerCallback):
        start_bytes = first_event = 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if trace_step is not None:
                torch.cuda.synchronize()
                self.start_bytes = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=10_000_000, stacks="python")

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            self.start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            if trace_step is not None and state.global_step + 1 == trace_step:
                self.first_event = len(torch.cuda.memory._snapshot()["device_traces"][0])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            torch.cuda.synchronize()
            rec.setdefault("step_peaks_gib", []).append(round(torch.cuda.max_memory_allocated() / GIB, 4))
            rec.setdefault("step_start_gib", []).append(round(self.start / GIB, 4))
            if trace_step is not None and state.global_step == trace_step:
                events = torch.cuda.memory._snapshot()["device_traces"][0]
                torch.cuda.memory._record_memory_history(enabled=None)
                peak, blocks = live_at_peak(events, self.start_bytes, self.first_event)
                rec["peak_trace"] = {
                    "step": trace_step, "peak_gib": round(peak / GIB, 4),
                    "before_step_gib": round(self.start / GIB, 4), "groups": group_blocks(blocks, top=40),
                    "contexts": group_blocks(blocks, label=context_label),
                    "pairs": group_blocks(blocks, top=40, label=lambda f: f"{context_label(f)} <- {frame_label(f)}"),
                    "events": len(events),
                }  # fmt: skip

    return StepPeaks()


def phase_marks_callback(rec: dict[str, Any], step: int) -> Any:
    """A TrainerCallback that, in step ``step`` (1-based), marks the memory allocated and the step's peak so far at
    each decoder layer's forward end and backward start (a hook on the layer's output and on its gradient, set in
    the first forward, not in a checkpoint's recompute) and at the step's end. The peak last rose between the mark
    before it and the first mark that shows it: that is where the step peaks. Stores ``rec["phase_marks"]``. The
    peak statistic is never reset here, so the per-step peaks of ``step_peaks_callback`` stay true."""
    import torch
    from transformers import TrainerCallback

    class PhaseMarks(TrainerCallback):
        armed = started = False
        handles: list[Any] = []
        marks: list[dict[str, Any]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if state.global_step + 1 != step or model is None:
                return
            layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
            self.armed, self.started, self.marks = True, False, []
            self.mark("step begins")
            self.handles = [layer.register_forward_hook(self.hook(i)) for i, layer in enumerate(layers)]

        def hook(self, index: int) -> Callable[..., None]:
            def on_output(module: Any, inputs: Any, output: Any) -> None:
                hidden = output[0] if isinstance(output, tuple) else output
                if self.armed and not self.started and torch.is_tensor(hidden) and hidden.requires_grad:
                    self.mark(f"layer {index} forward ends")
                    hidden.register_hook(lambda grad: self.mark(f"layer {index} backward starts", backward=True))

            return on_output

        def mark(self, event: str, backward: bool = False) -> None:
            self.started = self.started or backward
            allocated, peak = torch.cuda.memory_allocated() / GIB, torch.cuda.max_memory_allocated() / GIB
            self.marks.append({"at": event, "allocated_gib": round(allocated, 4), "peak_so_far_gib": round(peak, 4)})

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self.armed:
                return
            self.mark("step ends (after the optimizer step)")
            for handle in self.handles:
                handle.remove()
            self.armed = False
            rec["phase_marks"] = {"step": step, "marks": self.marks}

    return PhaseMarks()
