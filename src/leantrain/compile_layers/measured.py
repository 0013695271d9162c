"""Where compiling the decoder layers measured faster, per model family (data, read by the probe in auto mode).

One row per family: the step time saved and the one-off compile cost (the first step's extra time, cold caches),
measured on one GPU with LoRA r16 on every projection, head frozen, bf16, gradient checkpointing, AdamW,
4 x 2048 tokens. Auto mode applies ``compile_layers`` on CUDA when ``max_steps x saving > compile cost``;
``compile_layers=True`` compiles any family regardless. Update from ``benchmarks/bench_compile_layers.py`` (compiled
vs ``patch_trainer`` without it, each variant in its own process, same device) and the dense recipe's compiled
variant."""

from __future__ import annotations

from dataclasses import dataclass

from ..measured import Evidence


@dataclass(frozen=True)
class Measured:
    saving_ms: float  # per optimizer step, compiled vs patch_trainer's other defaults
    compile_s: float  # the first step's extra time with cold caches
    evidence: Evidence  # what the report quotes: device, date, shape, times


# Qwen2 and Gemma-2: H200, 2026-11-27, torch 2.11+cu130, TRL 1.15 SFTTrainer, layer.compile() per decoder layer on
# top of patch_trainer (the dense recipe's side-by-side runs); their cold start was not timed: Llama-3.2-1B's first
# layer compile (15.3 s there) stands in, more for Gemma-2 (a larger layer).
MEASURED: dict[str, Measured] = {
    # benchmarks/results/vs_unsloth.md (TRL 1.15 SFTTrainer, transformers 5.17, one process per variant, the same
    # run as stock and Unsloth): patch_trainer's defaults vs compile_layers=True; the compile cost is the first
    # step's difference (14.3 - 5.8 s). On varying lengths the compiled layers measured no faster than the fused
    # loss alone (5115 vs 5104 tok/s): the saving is the fixed-length one.
    "llama": Measured(
        52.3,
        8.5,
        Evidence(
            "faster",
            "H200",
            "2026-11-27",
            "Llama-3.2-1B LoRA SFT step 218.0 -> 165.7 ms at 4 x 2048, first step 5.8 -> 14.3 s (cold caches)",
        ),
    ),
    "qwen2": Measured(
        133.4, 15.3, Evidence("faster", "H200", "2026-11-27", "Qwen2.5-1.5B LoRA SFT step 351.7 -> 218.3 ms")
    ),
    "gemma2": Measured(
        165.3,
        20.0,
        Evidence("faster", "H200", "2026-11-27", "Gemma-2-2B LoRA SFT step 553.9 -> 388.6 ms (eager attention)"),
    ),
}

# Layers holding bitsandbytes 4-bit linears (QLoRA), weighed with this row in auto mode (for the families measured
# above): compiled, the step is faster and its peak memory lower (the LoRA linears' scaling on the rank-r side keeps
# the full-width gradient copies out of the backward). benchmarks/results/vs_unsloth_qlora_eager_compiled.md
# (nf4 double-quant, bf16 compute, the same run as the LoRA rows otherwise): patch_trainer with the layers eager vs
# compile_layers=True, one process each.
QUANTIZED_4BIT = Measured(
    53.7,
    10.2,
    Evidence(
        "faster",
        "H200",
        "2026-11-29",
        "Llama-3.2-1B QLoRA SFT step 259.0 -> 205.3 ms at 4 x 2048, peak memory 2.63 -> 2.43 GiB, first step 4.4 -> "
        "14.5 s (cold caches)",
    ),
)

# MoE layers whose 4-bit experts moe4bit serves (its grouped ops traced inside the compiled layer), weighed with this
# row in auto mode: benchmarks/results/moe_compiled_ab.md (one Qwen3-30B-A3B decoder layer, 128 experts top 8, nf4
# attention and experts, LoRA on both, 1 x 4096 tokens; one trainer alternating the layers eager and compiled in one
# process, two runs): the smaller of the two runs' savings, and the compiled run's whole first step
# (benchmarks/results/vs_unsloth.md, the moe-qlora row: the later of two rounds on a machine with empty compile
# caches, inductor's compile workers started at patch time, 19.2 and 18.2 s) as the compile cost: an upper bound of
# the first step's extra.
MOE_4BIT = Measured(
    9.9,
    18.2,
    Evidence(
        "faster",
        "H200",
        "2026-11-30",
        "one Qwen3-30B-A3B layer with moe4bit's 4-bit experts, QLoRA at 1 x 4096: step 29.1 -> 19.2 ms and 43.7 -> "
        "31.5 ms in two runs, first step 18.2 s compiled (cold caches)",
    ),
)

# compile_layers_background in auto mode: on for the MoE layers of the row above (its compile is the longest: 18-23 s
# on the first step in the training process). benchmarks/results/vs_unsloth_rounds_moe-qlora_background.md and
# vs_unsloth_rounds_moe-qlora_step_peaks.md (the same layer, the trainer told 1000 steps and timed for all of them,
# empty compile caches): the first step and the whole run against compile_layers=True compiling in the process.
BACKGROUND_MOE_4BIT = Evidence(
    "faster",
    "H200",
    "2026-12-02",
    "one Qwen3-30B-A3B layer with moe4bit's 4-bit experts, QLoRA at 1 x 4096: first step 6.0 / 5.8 / 7.9 s against "
    "20.4 / 22.8 s compiled in the training process, process start to the last of 1003 steps 76.3 / 70.2 s against "
    "74.2 / 79.3 s, peak 1.97 GiB (the eager layers') against 1.88",
)

# Families whose decoder layer does not compile on a torch version: (model_type, torch prefix) -> the error seen.
# The run-time fallback covers the ones not listed (the first call's compile error serves the eager layers).
KNOWN_FAILURES: dict[tuple[str, str], str] = {}
