"""What offloading the checkpointed layer inputs measured on CUDA (data, read by the probe in auto mode).

``benchmarks/results/offload_ab.md``, ``offload_ab_short_segments.md``, ``offload_ab_sink.md``,
``offload_ab_qlora_varlen.md`` and ``step_ab_llama_offload_chunks0.md``
(``bench_step_ab.py``: one trainer,
the compiled layers without and with the offload in alternating segments of one process): the step cost of the
offload against leantrain without it, and the peak memory it saves. Auto mode turns the offload on only where every
measured case cost at most ``MAX_COST`` of the step; ``offload_checkpoints=True`` applies it anyway."""

from __future__ import annotations

from dataclasses import dataclass

from ..measured import NOISE, Evidence


MAX_COST = NOISE  # the step cost auto mode accepts for the memory (3%: the timing noise)


@dataclass(frozen=True)
class Case:
    """One benchmark case: the offload's step cost (a share of the step) and the peak allocated GiB it saved."""

    cost: float
    saved_gib: float


# What auto mode would apply (the offload alone: the gated MLPs' backward unchunked; QLoRA's 4-bit MLPs have none
# to chunk) against the compiled layers alone, per case (LoRA r16 on the 7 projections, 4 x 2048 tokens, bf16,
# activation checkpointing): the worst run where a case ran more than once (Llama: +7.5%, -1.1% and, in 8 pairs of
# short segments, +0.4% and -3.6%; Qwen: -0.6%, +17.6% and, in 8 pairs, -6.8% and +2.4% (that run's rows did not
# come back: its log's table is in offload_ab_sink.md); QLoRA: +3.7%, +19.1%, -18.2%, -1.4% and, in 8 pairs, +3.1%
# (offload_ab_qlora_varlen.md); varying lengths: +6.6% and, in 8 pairs, -0.2%). The shared H200's host moved one
# variant's segment medians by up to 40% within a run on those days, and the copies hide under compute (the backward
# never waited for one): what a run pays is the hooks' host work, where the host issues the step about as fast as the
# GPU runs it. Over the pairs of each 8-pair run (each pair's ratio, which cancels the drift) the cost was -6.5% to
# +1.0%; the runs of fewer, longer segments measured up to +15% that way too (QLoRA, 6 pairs), so a slow host's
# share is real: auto mode still reads the worst run of each case. Longer paired runs on 2026-12-02
# (step_ab_offload_pairs_*.md: 16, 16 and 12 pairs, the same batches) put the padded cases within 3% at the median of
# the pairs (Llama -1.1%, QLoRA +1.4%, Qwen +2.2%) but Qwen's matched steps summed to +3.3%; with the hooks' host
# work cut again (SideStream), padding-free varying lengths measured 1.034x over 8 pairs and QLoRA 0.956x over 12
# (+4.4%; its GPU idle half the step, waiting on the host: step_ab_offload_qlora_profiled.md): not enough to turn it
# on.
MEASURED = {
    "llama-3.2-1b": Case(cost=0.075, saved_gib=0.37),
    "llama-3.2-1b-qlora": Case(cost=0.191, saved_gib=0.41),
    "llama-3.2-1b-varlen": Case(cost=0.066, saved_gib=0.28),
    "qwen2.5-1.5b": Case(cost=0.176, saved_gib=0.52),
}
EVIDENCE = Evidence(
    "not within 3%",
    "H200",
    "2026-11-30",
    "LoRA / QLoRA, 4 x 2048 tokens: "
    + ", ".join(f"{name} {c.saved_gib:.2f} GiB less at {c.cost:+.1%} a step" for name, c in MEASURED.items())
    + " (benchmarks/results/offload_ab.md, offload_ab_short_segments.md, offload_ab_sink.md)",
)


def pays_on_cuda() -> bool:
    """Whether every measured case stayed within ``MAX_COST``: auto mode's rule on CUDA."""
    return all(case.cost <= MAX_COST for case in MEASURED.values())
