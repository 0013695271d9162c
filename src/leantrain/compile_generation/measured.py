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


# benchmarks/results/compile_generation.{json,md}: one H200, torch 2.11+cu130, transformers 5.23, TRL 1.16, bf16,
# random-init Qwen2.5 shapes, 2 prompts x 8 generations x 256 new tokens a step, activation checkpointing; each
# variant in its own process with cold compile caches. Six runs (0.5B GRPO beta 0 and 0.04, 0.5B RLOO, 1.5B GRPO
# beta 0 and 0.04, the 7B shape with LoRA r16): the row takes the smallest saving a token (RLOO's) and the largest
# first-step cost (the 7B's), so the pay-back is the run's worst case.
MEASURED: dict[str, Measured] = {
    "qwen2": Measured(
        19.25,
        34.3,
        Evidence(
            "faster",
            "H200",
            "2026-11-29",
            "Qwen2.5-0.5B GRPO step 6328 -> 1277 ms (generation 6000 -> 929 ms), 1.5B 8629 -> 1725 ms, "
            "7B LoRA 17081 -> 4794 ms, RLOO 6388 -> 1546 ms, 16 x 256 tokens; first step up to 34.3 s over a warm "
            "stock step",
        ),
    ),
}
