"""Where compiled decoding measured faster, per model family (data, read by the probe in auto mode).

One row per family: the time saved per decoded token (one forward of the whole generation batch) and the one-off
compile cost (the first generation call's extra time, cold caches), measured on one GPU in a GRPO run against stock
``generate`` (dynamic cache). Auto mode applies ``compile_generation`` on CUDA when the run's generation calls x
``max_completion_length`` x saving exceed the compile cost; ``compile_generation=True`` compiles any family. Update
from ``benchmarks/bench_compile_generation.py``."""

from __future__ import annotations

from dataclasses import dataclass

from ..measured import Evidence


@dataclass(frozen=True)
class Measured:
    saving_ms: float  # per decoded token, stock generate minus compiled
    compile_s: float  # the first generation call's extra time
    evidence: Evidence  # what the report quotes: device, date, shape, times


MEASURED: dict[str, Measured] = {}
