"""Where the grouped 4-bit experts measured faster off CUDA, per trainer kind and shape (data, read by the probe in
auto mode; plain values).

Off CUDA, auto mode applies moe4bit only within :data:`~leantrain.measured.REACH` of a cell of the same device class
and trainer kind (experts per layer and hidden size each within the factor) whose verdict is ``"faster"``; the
nearest cell decides, a tie goes to the slower verdict. Anywhere else (no cell, or a nearest cell not measured faster)
the stock experts serve and ``moe4bit=True`` applies the grouped path anyway. On CUDA the probe does not read this
table. Fill it from ``leantrain demo`` / ``leantrain compare`` runs (each mode twice, steady-state medians after the
warm-up steps, p20-p80 bands): a cell is ``"faster"`` only where the bands do not overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..measured import REACH, Evidence


@dataclass(frozen=True)
class Cell:
    """One measured training run shape and its verdict."""

    device: str  # the device class: torch's device type
    kind: str  # the trainer kind: "sft", "grpo", "trainer"
    experts: int  # experts per layer
    hidden: int  # the model's hidden size
    evidence: Evidence  # verdict "faster" or "not faster", with where, when and the times


KIND_NAMES = {"sft": "SFT", "grpo": "GRPO", "trainer": "a plain Trainer"}

# `leantrain demo` on a 2-core Intel Xeon (torch 2.13 CPU, fp32): tiny gpt-oss, 2 layers, hidden 64, expert
# intermediate 64, frozen nf4 Linear4bit expert lists, batch 8 x 128 tokens, 30 steps, 2 runs per mode, steady-state
# medians after the warm-up steps.
_DEMO = "2-core Intel Xeon CPU, torch 2.13, fp32"
CELLS: tuple[Cell, ...] = (
    Cell(
        "cpu",
        "sft",
        32,
        64,
        Evidence(
            "faster",
            _DEMO,
            "2026-11-29",
            "SFT, tiny gpt-oss with 32 frozen nf4 experts a layer, hidden 64, 8 x 128 tokens: stock 231 / 216 ms a "
            "step, moe4bit 168 / 170 ms (1.35x)",
        ),
    ),
    Cell(
        "cpu",
        "sft",
        8,
        64,
        Evidence(
            "not faster",
            _DEMO,
            "2026-11-29",
            "SFT, tiny gpt-oss with 8 frozen nf4 experts a layer, hidden 64, 8 x 128 tokens: stock 196 / 183 ms a "
            "step, moe4bit 165 / 136 ms, within the noise (the p20-p80 bands overlap)",
        ),
    ),
    Cell(
        "cpu",
        "grpo",
        8,
        64,
        Evidence(
            "faster",
            _DEMO,
            "2026-11-29",
            "GRPO (TRL GRPOTrainer, 4 prompts x 4 generations x 24 tokens, generation included), tiny gpt-oss with 8 "
            "frozen nf4 experts a layer, hidden 64, 12 steps, moe4bit alone: stock 325 / 334 ms a step, moe4bit "
            "259 / 232 ms (1.35x; p20-p80 307-411 vs 224-282 ms)",
        ),
    ),
)


def choose(
    device: str, kind: str, experts: int, hidden: int | None, cells: tuple[Cell, ...] = CELLS
) -> tuple[bool, str]:
    """(whether auto mode applies the grouped path, why) for one experts shape on one device class and trainer
    kind."""
    size = f"{experts} experts a layer, hidden {hidden if hidden is not None else 'unknown'}"
    shape = f"{KIND_NAMES.get(kind, kind)} with {size}"
    near = [
        c
        for c in cells
        if (c.device, c.kind) == (device, kind)
        and hidden is not None
        and max(_ratio(c.experts, experts), _ratio(c.hidden, hidden)) <= REACH
    ]
    if not near:
        return False, f"not measured on {device} for {shape}: the stock experts"
    cell = min(near, key=lambda c: (_distance(c, experts, hidden), c.evidence.faster))  # a tie: the slower verdict
    where = f"{cell.experts} experts a layer, hidden {cell.hidden} ({cell.evidence})"
    if cell.evidence.faster:
        return True, f"measured faster on {device} at {where}"
    return False, f"not measured faster on {device} for {shape}: nearest measured at {where}; the stock experts"


def _ratio(a: int, b: int) -> float:
    return max(a, b) / max(1, min(a, b))


def _distance(cell: Cell, experts: int, hidden: int) -> float:
    return abs(math.log(cell.experts / experts)) + abs(math.log(cell.hidden / hidden))
