"""What offloading the checkpointed layer inputs measured on CUDA (data, read by the probe in auto mode).

``benchmarks/results/offload_checkpoints.md`` (``bench_offload_checkpoints.py``: ``patch_trainer`` with and without
the offload, each in its own process, every case twice in alternating order): the step cost of the offload against
leantrain without it, and the peak memory it saves. Auto mode turns the offload on only where every measured case
cost at most ``MAX_COST`` of the step; ``offload_checkpoints=True`` applies it anyway."""

from __future__ import annotations

from dataclasses import dataclass

from ..measured import NOISE, Evidence


MAX_COST = NOISE  # the step cost auto mode accepts for the memory (3%: the timing noise)


@dataclass(frozen=True)
class Case:
    """One benchmark case: the offload's step cost (a share of the step) and the peak allocated GiB it saved."""

    cost: float
    saved_gib: float


# Median step of leantrain_offload against leantrain, and the drop in peak allocated memory, per case (LoRA r16 on
# the 7 projections, 4 x 2048 tokens, bf16, activation checkpointing; the trainer told a 1000-step run; the layers
# compiled, QLoRA's included; with the offload, Llama's and Qwen's gated MLPs run their backward in 4 row chunks).
# Every case twice in alternating order, both variants in one call (Llama, Qwen) or QLoRA's leantrain run from an
# earlier call. The chunks' host work is most of the cost (the offload alone measured within noise on Qwen): a
# layer's backward is issued about as fast as the GPU runs it. The shared GPU moves a step by up to 15% within one
# call (Qwen's offload runs: 313 and 263 ms).
MEASURED = {
    "llama-3.2-1b": Case(cost=0.1831, saved_gib=0.46),
    "llama-3.2-1b-qlora": Case(cost=0.0654, saved_gib=0.50),
    "qwen2.5-1.5b": Case(cost=0.2432, saved_gib=0.64),
}
EVIDENCE = Evidence(
    "not within 3%",
    "H200",
    "2026-11-29/30",
    "LoRA / QLoRA, 4 x 2048 tokens: "
    + ", ".join(f"{name} {c.saved_gib:.2f} GiB less at {c.cost:+.1%} a step" for name, c in MEASURED.items())
    + " (benchmarks/results/offload_checkpoints.md)",
)


def pays_on_cuda() -> bool:
    """Whether every measured case stayed within ``MAX_COST``: auto mode's rule on CUDA."""
    return all(case.cost <= MAX_COST for case in MEASURED.values())
