"""What offloading the checkpointed layer inputs measured on CUDA (data, read by the probe in auto mode).

``benchmarks/results/offload_toggle_*.md`` (``bench_offload_toggle.py``: one trainer patched once with the offload
and the compiled layers, the offload's hooks paused on one step of each pair, the order drawn by a seeded coin, 100
pairs): the step cost of the offload against the same trainer without it, and the peak memory it saved. Auto mode
turns the offload on only where every measured case cost at most ``MAX_COST`` of the step;
``offload_checkpoints=True`` applies it anyway."""

from __future__ import annotations

from dataclasses import dataclass

from ..measured import NOISE, Evidence


MAX_COST = NOISE  # the step cost auto mode accepts for the memory (3%: the timing noise)


@dataclass(frozen=True)
class Case:
    """One benchmark case: the offload's step cost (a share of the step) and the peak allocated GiB it saved."""

    cost: float
    saved_gib: float


# The offload's step cost per case (LoRA r16 on the 7 projections, 4 x 2048 tokens, bf16, activation checkpointing,
# the compiled layers in both), measured a step apart: the worst run's pairs' median ratio (Llama +0.5% to +3.6% over
# nine runs, QLoRA +1.6% to +5.9% over five, Qwen +2.6% and +3.0%; varying lengths, each batch trained twice in a row
# so a pair's steps train the same rows, +3.0%, +2.5% and +2.6%: earlier runs whose pairs trained different batches
# gave +2.1% to +6.6% at the median and summed ratios spread by several percent either way, and are left out). These
# steps are host-bound (the GPU idle a quarter of a fixed-length step without the offload, three quarters of a
# padding-free one), so the offload's host work adds to the step almost one for one: its hooks' own calls cost -0.1%
# to +0.6% of the step (a diagnostic whose copies move 1 KiB and whose inputs stay on the device), the bytes the
# copies move through host memory make the host slower everywhere (3.1-4.8 ms a step inside the hooks instead of
# 0.7), and keeping the inputs on the device (nothing freed) costs as much (varying lengths, same batches: +6.2%
# against +3.0%). The cost moves with the host: one host ran Llama at +0.5%, another at +3.6%, and +2.2% and +2.3%
# later the same day. Summed over a run, the offloaded steps took 0.94-1.03x the paused ones' time (the runs' few
# 0.5-0.8 s steps fall on either). Runs with some of the layers (``offload_checkpoints_layers``,
# ``offload_toggle_*_half*.md``) are another trade and are not read here. Earlier runs in alternating segments of
# several steps (offload_ab*.md, step_ab_offload_pairs_*.md) gave -3.6% to +19.1%: the shared host's drift over a
# segment's seconds, which a step apart cancels.
MEASURED = {
    "llama-3.2-1b": Case(cost=0.036, saved_gib=0.40),
    "llama-3.2-1b-qlora": Case(cost=0.059, saved_gib=0.43),
    "llama-3.2-1b-varlen": Case(cost=0.030, saved_gib=0.30),
    "qwen2.5-1.5b": Case(cost=0.030, saved_gib=0.54),
}
EVIDENCE = Evidence(
    "not within 3%",
    "H200",
    "2026-12-03",
    "LoRA / QLoRA, 4 x 2048 tokens: "
    + ", ".join(f"{name} {c.saved_gib:.2f} GiB less at {c.cost:+.1%} a step" for name, c in MEASURED.items())
    + " (benchmarks/results/offload_toggle_*.md)",
)


def pays_on_cuda() -> bool:
    """Whether every measured case stayed within ``MAX_COST``: auto mode's rule on CUDA."""
    return all(case.cost <= MAX_COST for case in MEASURED.values())
