"""The offloaded checkpoints' hooks on the host: what ``HostOffload``'s saved-tensor hooks add to the host's time to
issue a step of checkpointed layers, and what each CUDA call they make costs the host.

The offload's copies run on a side stream beside the compute, so on a GPU-bound step they cost nothing; where the
host issues the step about as fast as the GPU runs it (small models, varying lengths, a loaded host), the hooks' own
host work is the offload's cost. This measures it apart from any model: a chain of ``--layers`` checkpointed layers
(a trivial layer, ``t * 1.0001 + 1e-3``, so the hooks' share shows), forward and backward, with and without the
hooks (``HostOffload.context()`` around each checkpoint call, as the patch enters it). Each repetition first puts a
sleep kernel on the GPU, so the host issues the whole chain while the GPU is busy: ``time.perf_counter`` around the
issue is the host's time, CUDA events around the chain the GPU's. The variants alternate within each round;
medians over ``--rounds`` x ``--reps``. Then the host cost of each CUDA call the hooks make (the same sleep first),
which says where a layer's hook time goes. ``--baseline-ops FILE`` adds a third variant, the ``HostOffload`` of another
copy of ``offload_checkpoints/ops.py`` (e.g. ``git show REV:src/leantrain/offload_checkpoints/ops.py > old_ops.py``),
timed in the same rounds: a change to the hooks against what it replaces, on the same host at the same time.

Writes ``offload_hooks.json`` / ``.md`` / ``.png`` to ``$BENCH_RESULTS`` or ``benchmarks/results``:

    python benchmarks/bench_offload_hooks.py                  # CUDA, about a minute
    python benchmarks/bench_offload_hooks.py --baseline-ops old_ops.py   # the hooks now against an older copy
    python benchmarks/bench_offload_hooks.py --smoke          # CPU, seconds (the hooks' host copies; no CUDA calls)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _harness import Row, bar_plot, markdown_table, write_results
from torch.utils.checkpoint import checkpoint

from leantrain.offload_checkpoints.ops import HostOffload, SideStream
from leantrain.offload_checkpoints.probe import MIN_BYTES


SLEEP_MS = 60.0  # the GPU's busy time before each repetition: longer than the host takes to issue a chain
PRIMITIVE_CALLS = 400
VARIANT_TEXT = {"hooks": "this checkout's", "baseline_hooks": "the baseline's (--baseline-ops)"}


def trivial_layer(t: torch.Tensor) -> torch.Tensor:
    return t * 1.0001 + 1e-3


def run_chain(x: torch.Tensor, layers: int, hooks: HostOffload | None) -> None:
    h = x * 1.0  # not a leaf: the hooks move it (a leaf that requires grad stays, see HostOffload.pack)
    for _ in range(layers):
        with hooks.context() if hooks is not None else contextlib.nullcontext():
            h = checkpoint(trivial_layer, h, use_reentrant=False)
    h.sum().backward()


class GpuBusy:
    """A sleep kernel of ``ms`` milliseconds before each timed call (none on CPU), its cycles per millisecond
    measured once."""

    def __init__(self, cuda: bool, ms: float = SLEEP_MS) -> None:
        self.cycles = 0
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(10_000_000)
            end.record()
            end.synchronize()
            self.cycles = int(ms * 10_000_000 / start.elapsed_time(end))

    def __call__(self) -> None:
        if self.cycles:
            torch.cuda._sleep(self.cycles)


def time_chain(x: torch.Tensor, layers: int, hooks: HostOffload | None, busy: GpuBusy) -> tuple[float, float | None]:
    """One repetition: (host ms to issue the chain, GPU ms it ran; None on CPU)."""
    cuda = x.is_cuda
    if cuda:
        torch.cuda.synchronize()
    busy()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
    if events:
        events[0].record()
    start = time.perf_counter()
    run_chain(x, layers, hooks)
    host_ms = (time.perf_counter() - start) * 1e3
    if not events:
        return host_ms, None
    events[1].record()
    events[1].synchronize()
    return host_ms, events[0].elapsed_time(events[1])


def baseline_hooks(path: Path) -> type:
    """``HostOffload`` of another copy of ``ops.py`` (a module of plain imports: torch and the standard library)."""
    if not path.is_file():
        raise SystemExit(f"--baseline-ops {path}: no such file")
    spec = importlib.util.spec_from_file_location("baseline_offload_ops", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - any import failure of that copy is the user's to see
        raise SystemExit(f"--baseline-ops {path} does not import on its own: {type(error).__name__}: {error}")
    if not hasattr(module, "HostOffload"):
        raise SystemExit(f"--baseline-ops {path} has no HostOffload")
    return module.HostOffload


def chain_rows(args: argparse.Namespace, device: torch.device, busy: GpuBusy) -> list[Row]:
    rows = []
    min_bytes = MIN_BYTES if device.type == "cuda" else 0
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        variants: dict[str, Any] = {"stock": None, "hooks": HostOffload(budget_bytes=1 << 40, min_bytes=min_bytes)}
        if args.baseline_ops:
            variants["baseline_hooks"] = baseline_hooks(Path(args.baseline_ops))(1 << 40, min_bytes)
        for variant in variants.values():  # warm-up: the allocators' blocks, the side stream, pinned memory
            time_chain(x, args.layers, variant, busy)
        packed_before = {name: v.stats.packed for name, v in variants.items() if v is not None}
        times: dict[str, list[tuple[float, float | None]]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for _ in range(args.reps):
                for name, variant in variants.items():
                    times[name].append(time_chain(x, args.layers, variant, busy))
        for name, samples in times.items():
            hooks = variants[name]
            host = sorted(t[0] for t in samples)
            gpu = [t[1] for t in samples if t[1] is not None]
            packed = (hooks.stats.packed - packed_before[name]) / len(samples) if hooks is not None else 0
            config = {"layers": args.layers, "hidden": args.hidden, "dtype": "bfloat16", "samples": len(samples),
                      "gpu_ms": statistics.median(gpu) if gpu else None, "packed_per_chain": packed,
                      "fetched_ahead": hooks.stats.fetched_ahead if hooks is not None else 0,
                      "waited": hooks.stats.waited if hooks is not None else 0,
                      "ops": args.baseline_ops if name == "baseline_hooks" else None}  # fmt: skip
            spread = percentile(host, 0.2), percentile(host, 0.8)
            rows.append(Row("offload_hooks", name, "chain", "host time", "ms", "tokens", tokens,
                            statistics.median(host), *spread, config))  # fmt: skip
    return rows


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def primitives(device: torch.device) -> dict[str, Callable[[], object]]:
    """The CUDA calls of ``HostOffload.pack`` / ``unpack``, each alone (a 1 MiB bf16 tensor)."""
    side, event = torch.cuda.Stream(device), torch.cuda.Event()
    x = torch.randn(512, 1024, device=device, dtype=torch.bfloat16)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)

    def side_after_compute() -> None:
        event.record(torch.cuda.current_stream(device))
        side.wait_event(event)

    def copy_on_side() -> None:
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)

    def stream_context() -> None:
        with torch.cuda.stream(side):
            pass

    def empty_and_record_stream() -> None:
        torch.empty(x.shape, dtype=x.dtype, device=device).record_stream(side)

    def new_event() -> None:
        torch.cuda.Event().record(side)

    lane = SideStream(device)
    compute = lane.compute()

    def set_stream_there_and_back() -> None:
        torch.cuda.set_stream(lane.stream)
        torch.cuda.set_stream(compute)

    return {
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(device),
        "event.record(current stream) + side.wait_event (the side stream after the compute)": side_after_compute,
        "with torch.cuda.stream(side): (entered and left, empty)": stream_context,
        "host.copy_(x, non_blocking=True) on the compute stream": lambda: host.copy_(x, non_blocking=True),
        "the same inside with torch.cuda.stream(side)": copy_on_side,
        "torch.empty(pin_memory=True) (a cached block)": lambda: torch.empty(x.shape, dtype=x.dtype, pin_memory=True),
        "torch.empty on the device (a cached block)": lambda: torch.empty(x.shape, dtype=x.dtype, device=device),
        "torch.empty on the device + record_stream(side)": empty_and_record_stream,
        "torch.cuda.Event() + record": new_event,
        "SideStream.compute() (the current stream, one object kept per raw stream)": lane.compute,
        "torch.cuda.set_stream(side) + set_stream(compute) (SideStream.copy's switch)": set_stream_there_and_back,
        "SideStream.copy(host, x) (the side after the compute, the copy there)": lambda: lane.copy(host, x, compute),
    }


def primitive_rows(device: torch.device, busy: GpuBusy, calls: int = PRIMITIVE_CALLS) -> list[Row]:
    rows = []
    for name, call in primitives(device).items():
        torch.cuda.synchronize()
        busy()
        for _ in range(20):
            call()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        us = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        rows.append(Row("offload_hooks", "primitive", "call", "host time", "us", "call", name, us,
                        config={"calls": calls}))  # fmt: skip
    return rows


def table(rows: list[Row]) -> str:
    chains = {(r.x_value, r.provider): r for r in rows if r.mode == "chain"}
    lines = []
    for (tokens, variant), hooks in chains.items():
        if variant == "stock":
            continue
        stock = chains[(tokens, "stock")]
        extra = hooks.p50 - stock.p50
        lines.append([tokens, VARIANT_TEXT[variant], f"{stock.p50:.2f} ({stock.p20:.2f}-{stock.p80:.2f})",
                      f"{hooks.p50:.2f} ({hooks.p20:.2f}-{hooks.p80:.2f})", f"{extra:+.2f}",
                      f"{extra / hooks.config['layers'] * 1e3:.0f}", f"{hooks.config['packed_per_chain']:g}",
                      " / ".join("–" if r.config["gpu_ms"] is None else f"{r.config['gpu_ms']:.3f}"
                                 for r in (stock, hooks))])  # fmt: skip
    first = next(r for r in rows if r.mode == "chain").config
    text = markdown_table(
        ["tokens", "hooks", "stock checkpointing, host ms (p20-p80)", "with the hooks, host ms", "hooks' ms a step",
         "µs a layer (forward and backward)", "inputs moved a step", "GPU ms stock / hooks"],
        lines,
    )  # fmt: skip
    baseline = next((r.config["ops"] for r in rows if r.provider == "baseline_hooks"), None)
    if baseline:
        text += f"\n\nThe baseline hooks: `HostOffload` of `{baseline}`."
    text += (
        f"\n\n{first['layers']} checkpointed layers (a trivial layer), hidden {first['hidden']}, bf16, forward and "
        "backward; the host's time to issue the chain while a sleep kernel keeps the GPU busy, medians of "
        f"{first['samples']} repetitions a variant, the variants alternating."
    )
    calls = [r for r in rows if r.mode == "call"]
    if calls:
        text += "\n\nThe host cost of each CUDA call the hooks make (a 1 MiB tensor, the GPU kept busy):\n\n"
        text += markdown_table(["call", "host µs"], [[r.x_value, f"{r.p50:.2f}"] for r in calls])
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the hooks' host copies)")
    parser.add_argument("--tokens", default="2048,8192", help="comma-separated tokens of a layer input")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--baseline-ops", default="", help="another copy of offload_checkpoints/ops.py to time beside")
    parser.add_argument("--out", default="", help="results directory (default $BENCH_RESULTS or benchmarks/results)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: the hooks' CUDA work is what this measures (--smoke runs them on the CPU)")
    if args.smoke:
        args.tokens, args.hidden, args.layers, args.rounds, args.reps = "16,32", 8, 4, 2, 2
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    if not args.tokens or min(args.tokens) < 1 or min(args.hidden, args.layers, args.rounds, args.reps) < 1:
        raise SystemExit("--tokens, --hidden, --layers, --rounds and --reps must be positive")
    device = torch.device("cuda" if cuda else "cpu")
    busy = GpuBusy(cuda)
    rows = chain_rows(args, device, busy)
    if cuda:
        rows += primitive_rows(device, busy)
    name = "offload_hooks_smoke" if args.smoke else "offload_hooks"
    out = write_results(name, rows, table(rows), Path(args.out) if args.out else None)
    chains = [r for r in rows if r.mode == "chain"]
    series = {p: [r.p50 for r in chains if r.provider == p] for p in dict.fromkeys(r.provider for r in chains)}
    bar_plot(out / f"{name}.png", "host time to issue the checkpointed chain", [str(t) for t in args.tokens], series,
             "host ms (tokens of a layer input below)")  # fmt: skip
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
