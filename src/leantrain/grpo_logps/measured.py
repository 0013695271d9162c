"""Where the fused log-probs measured faster, by device class (data, read by the probe in auto mode).

GRPO's training step outside generation measured faster with the fused log-probs on CUDA
(``benchmarks/results/recipes.md``, ``bench_recipes.py``: stock and leantrain in one process, seeded, medians after
warm-up). Nothing was measured on another device class: there auto mode keeps TRL's own log-probs, and
``grpo_logps=True`` applies the fused ones anyway."""

from __future__ import annotations

from ..measured import Evidence


MEASURED_ON = ("cuda",)  # device classes (torch's device types) with a measured step
EVIDENCE = Evidence(
    "faster",
    "H100",
    "2026-11-23",
    "GRPO Qwen2.5-0.5B, 16 completions x 256 tokens, beta=0: 233 -> 186 ms a step outside generation "
    "(benchmarks/results/recipes.md)",
)


def device_reason(device: str) -> str | None:
    """Why auto mode keeps TRL's log-probs on ``device`` (torch's device type), or None where it was measured."""
    if device in MEASURED_ON:
        return None
    return f"not measured on {device} (measured on {', '.join(MEASURED_ON)} only: {EVIDENCE}): TRL's own log-probs"
