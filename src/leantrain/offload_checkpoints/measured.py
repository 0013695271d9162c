"""What offloading the checkpointed layer inputs measured on CUDA (data, read by the probe in auto mode).

``benchmarks/results/offload_toggle_*.md`` (``bench_offload_toggle.py``: one trainer patched once with the offload
and the compiled layers, the offload's hooks paused on one step of each pair, the order drawn by a seeded coin, 40
to 100 pairs): the step cost of the offload against the same trainer without it, and the peak memory it saved, per
case and micro-batch size. Auto mode moves the inputs of micro-batches of at least ``AUTO_MIN_TOKENS`` tokens, the
size from which every measured case cost at most ``MAX_COST`` of the step; shorter ones keep stock checkpointing.
``offload_checkpoints=True`` moves every micro-batch's."""

from __future__ import annotations

from dataclasses import dataclass

from ..measured import NOISE, Evidence


MAX_COST = NOISE  # the step cost auto mode accepts for the memory (3%: the timing noise)
NEAR = 1.5  # a case's run counts for a micro-batch size from it up to this many times it
CASES = ("llama-3.2-1b", "llama-3.2-1b-qlora", "llama-3.2-1b-varlen", "qwen2.5-1.5b")


@dataclass(frozen=True)
class Run:
    """The worst run of one case at one micro-batch size: the offload's step cost (a share of the step) and the peak
    allocated GiB it saved."""

    case: str
    tokens: int  # a micro-batch's tokens: rows x length, or with varying lengths the median of its batches' sums
    cost: float
    saved_gib: float


# LoRA r16 on the 7 projections, bf16, activation checkpointing, the compiled layers in both; each row the worst
# run's pairs' median ratio. At 4 x 2048 tokens the step is host-bound (the GPU idle a quarter of the step without
# the offload, three quarters with padding-free varying lengths of about 2,300 tokens a micro-batch), so the hooks'
# host work and the host's slowdown while the copies stream through its memory add to the step almost one for one,
# and the cost follows the host: Llama +0.5% to +3.6% over eleven runs, QLoRA +1.6% to +5.9% over six, Qwen +2.6% to
# +3.5% over three, varying lengths +2.5% to +4.6% over four (each batch trained twice in a row; earlier runs whose
# pairs trained different batches are left out; one seed's batches sum to about 2,000 tokens, the others' to
# 2,300). More tokens a micro-batch give the GPU more work a layer against the same host work. In two device calls
# of 2026-12-03 afternoon (H200 machines on which Llama at 4 x 2048 cost +1.4%): 6 x 2048 cost Llama
# +0.6% and QLoRA +2.4%; 8 x 2048 cost Llama +0.3% and +0.7%, QLoRA +1.2% and +0.7%, Qwen +0.1% (a run whose JSON did
# not come back) and +1.0%; 32 varying-length rows (16,432 to 27,811 tokens a micro-batch) +0.2%.
# Runs with some of the layers (``offload_checkpoints_layers``, ``offload_toggle_*_half*.md``) are another trade and
# are not read here.
MEASURED = (
    Run("llama-3.2-1b", 8192, 0.036, 0.40),
    Run("llama-3.2-1b-qlora", 8192, 0.059, 0.43),
    Run("llama-3.2-1b-varlen", 1976, 0.046, 0.28),
    Run("llama-3.2-1b-varlen", 2265, 0.030, 0.30),
    Run("qwen2.5-1.5b", 8192, 0.035, 0.55),
    Run("llama-3.2-1b", 12288, 0.006, 0.62),
    Run("llama-3.2-1b-qlora", 12288, 0.024, 0.64),
    Run("llama-3.2-1b", 16384, 0.0066, 0.84),
    Run("llama-3.2-1b-qlora", 16384, 0.0116, 0.86),
    Run("qwen2.5-1.5b", 16384, 0.0101, 1.155),
    Run("llama-3.2-1b-varlen", 21240, 0.0022, 1.45),
)
# The smallest micro-batch size near which every case was measured and from which every run cost at most MAX_COST
# (12,288 tokens stayed within it on the two cases measured there, QLoRA at +2.4% on a fast host; the varying lengths
# were measured from 16,432 tokens a micro-batch on).
AUTO_MIN_TOKENS = 16384
EVIDENCE = Evidence(
    f"within 3% from {AUTO_MIN_TOKENS} tokens a micro-batch",
    "H200",
    "2026-12-03",
    "LoRA / QLoRA, the worst run of each: "
    + "; ".join(
        f"{tokens} tokens: "
        + ", ".join(f"{r.case} {r.saved_gib:.2f} GiB less at {r.cost:+.1%}" for r in MEASURED if r.tokens == tokens)
        for tokens in sorted({r.tokens for r in MEASURED})
    )
    + " a step (benchmarks/results/offload_toggle_*.md)",
)


def within_from(min_tokens: int) -> bool:
    """Whether every case was measured near ``min_tokens`` tokens a micro-batch (from it to ``NEAR`` times it: the
    cost falls as the micro-batches grow, so a run far above says little of the size itself) and every run from it
    on cost at most ``MAX_COST``."""
    above = [r for r in MEASURED if r.tokens >= min_tokens]
    near = {r.case for r in above if r.tokens < NEAR * min_tokens}
    return near == set(CASES) and all(r.cost <= MAX_COST for r in above)
