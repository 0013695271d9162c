"""Recompute or saved stacks, per layout and shape: whether backward dequantizes each expert stack again (recompute:
one bf16 stack alive at a time) or keeps the stack dequantized in forward (saved stacks: faster, the layer's
dequantized stacks stay alive until its backward). A small table of measured verdicts, plain values; the explicit
option (``moe_recompute`` / ``LEANTRAIN_MOE_RECOMPUTE`` = 1 or 0) overrides it.

A verdict applies to its layout and to layers whose largest dequantized stack is at most ``max_stack_mib`` (None:
any size), first match wins; a layout without a verdict recomputes (the smaller peak). Fill it from measurements
(device, shape, ms and peak each way). Those below come from one-layer runs per layout
(``benchmarks/results/moe4bit_recompute.md``; ``moe4bit_modulelist.md`` for the 4.x blocks). The kept benchmarks
measure them again: ``python benchmarks/bench_moe4bit.py --shape <shape>`` times a layer of per-expert ``Linear4bit``
lists with recompute on and off (``leantrain grouped`` and ``... (no recompute)``, ms and peak each) beside
transformers' ``grouped_mm`` over the same 4-bit stacks; for 3-D stacks and 4.x blocks, run
``benchmarks/bench_moe4bit_step.py`` (``--transformers4`` for the blocks) once with ``LEANTRAIN_MOE_RECOMPUTE=1`` and
once with ``=0``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..measured import Evidence


@dataclass(frozen=True)
class Verdict:
    layout: str  # "linear4bit" | "stacked" | "expert_mlps"
    recompute: bool
    measured: Evidence | str  # what the choice rests on, for the report
    max_stack_mib: float | None = None


def _h100(detail: str) -> Evidence:
    """Every verdict below: measured on an H100 on 2026-11-25."""
    return Evidence("recompute", "H100", "2026-11-25", detail)


# H100, 2026-11-25 (benchmarks/results/moe4bit_recompute.md): saved stacks were 2-25% faster a layer at every measured
# point (gpt-oss-20b and Qwen3-30B-A3B layers, 2048 and 4096 tokens) but held 0.6-1.0 GiB more, as much as
# transformers' own grouped_mm over the same 4-bit stacks. leantrain promises one dequantized bf16 stack alive at a
# time (what lets a whole 30B MoE train in 1.4 GiB beyond weights and optimizer state), so recompute stays the
# default on both layouts; LEANTRAIN_MOE_RECOMPUTE=0 buys the speed where the memory is there.
VERDICTS: tuple[Verdict, ...] = (
    Verdict(
        "linear4bit",
        True,
        _h100(
            "gpt-oss-20b layer, 4096 tokens: 10.08 ms / 1.41 GiB peak; saved stacks 9.57 ms / 2.45 GiB "
            "(moe_recompute=0 when the memory is there)",
        ),
    ),
    Verdict(
        "stacked",
        True,
        _h100(
            "Qwen3-30B-A3B layer, 4096 tokens: 5.78 ms / 0.97 GiB peak; saved stacks 5.31 ms / 1.82 GiB, "
            "transformers' grouped_mm on the same 4-bit stacks 5.39 ms / 1.77 GiB (moe_recompute=0 when the memory "
            "is there)",
        ),
    ),
    Verdict(
        "expert_mlps",
        True,
        _h100(
            "Qwen3-30B-A3B layer, 4096 tokens: 5.58 ms / 0.99 GiB peak; saved stacks 4.72 ms / 1.83 GiB",
        ),
    ),
)

NOT_MEASURED = "no measured verdict for this layout and shape: the smaller peak"


def choose(layout: str, stack_bytes: int, explicit: bool | None) -> tuple[bool, str]:
    """(recompute, why) for one experts module: the explicit option if set, else the first matching verdict."""
    if explicit is not None:
        return explicit, "set by moe_recompute / LEANTRAIN_MOE_RECOMPUTE"
    mib = stack_bytes / 2**20
    for verdict in VERDICTS:
        if verdict.layout == layout and (verdict.max_stack_mib is None or mib <= verdict.max_stack_mib):
            return verdict.recompute, f"measured: {verdict.measured}"
    return True, NOT_MEASURED


def describe(recompute: bool, why: str) -> str:
    """The report's words: ``recompute on (measured: ...)`` or ``recompute off, saved stacks (...)``."""
    return f"recompute on ({why})" if recompute else f"recompute off, saved stacks ({why})"
