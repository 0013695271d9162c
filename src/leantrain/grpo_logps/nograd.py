"""The no-grad rule: no-grad calls on TRL's fused path go to TRL's own head.

GRPO scores the old policy and the reference model under ``torch.no_grad()``. ``python benchmarks/bench_grpo_logps.py
--nograd`` times TRL 1.16's fused head against leantrain's Triton op on such calls (bf16, with and without the
entropy, the heads of Qwen2.5-0.5B to 14B and Llama-3-8B: H 896-5120, V 128256-152064, N 1024-16384). TRL's head
measured faster or within the timing noise in every cell of ``benchmarks/results/grpo_logps_nograd.json``, so the
rule needs no H, N, dtype or entropy (and no label count: no host sync). Nothing was measured off Triton or beyond
``V_REACH`` times the measured vocabularies: leantrain's op serves those calls, and every call that wants a gradient.
``python benchmarks/bench_grpo_logps.py --emit-rule`` checks a new run against this rule."""

from __future__ import annotations

from ..measured import NOISE, REACH, Evidence, beyond_noise


__all__ = ["EVIDENCE", "MEASURED_V", "NOISE", "SOURCE", "V_REACH", "trl_head_serves", "trl_head_wins"]
# Pasted from ``--emit-rule``: where and when, and the rule's reach in vocabulary
SOURCE = "NVIDIA H100 80GB HBM3, 2026-11-25, grpo_logps_nograd.json at 0a6f1e8"
MEASURED_V = (128256, 152064)  # the smallest and largest vocabulary measured
EVIDENCE = Evidence.parse("TRL's head faster or within the noise in every cell", SOURCE)
V_REACH = REACH


def trl_head_wins(stock_ms: float, fused_ms: float) -> bool:
    """One measured cell's verdict. leantrain's op wins only where it was faster beyond the noise (a tie goes to the
    head it would replace), so the rule does not depend on N."""
    return not beyond_noise(fused_ms, stock_ms)


def trl_head_serves(v: int, backend: str) -> bool:
    """Whether a no-grad call on TRL's fused path, against a head of ``v`` rows, goes to TRL's head rather than
    leantrain's op on ``backend``."""
    return backend == "triton" and MEASURED_V[0] / V_REACH <= v <= MEASURED_V[1] * V_REACH
