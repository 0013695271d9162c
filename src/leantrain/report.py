"""What patch_trainer did: one outcome per optimization, rendered as an aligned table."""

from __future__ import annotations

import dataclasses
import enum
import textwrap
from dataclasses import dataclass, field
from typing import Any


WIDTH = 119  # printed lines at most this long: a report pasted into a terminal or an issue reads without scrolling
MIN_REASON = 40  # the reason column never narrower, however wide the columns before it


def _wrapped(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` characters, every word kept (a word longer than a line is split, not
    cut); at least one line."""
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def size_text(n: float) -> str:
    """Bytes as a person reads them in a report: GiB from a quarter GiB on, MiB from 1 MiB on, KiB from 1 KiB on."""
    if n >= 2**28:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n:.0f} bytes"


class Status(str, enum.Enum):
    APPLIED = "applied"
    SKIPPED = "skipped"  # the probe declined (auto mode) or the optimization does not fit this trainer
    FAILED = "failed"  # applied, then a runtime error switched it back to the stock path
    DISABLED = "disabled"  # turned off by keyword or environment


@dataclass(frozen=True)
class PatchOutcome:
    name: str
    status: Status
    source: str  # kwarg / cli / env / default: where the on/off decision came from
    reasons: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()  # qualified names of what was patched
    detail: str = ""  # which path runs, e.g. "in-forward hook router, chunked CE on kept rows"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["status"] = self.status.value
        out["reasons"] = list(self.reasons)
        out["targets"] = list(self.targets)
        return out


@dataclass(frozen=True)
class PatchReport:
    trainer_kind: str
    outcomes: tuple[PatchOutcome, ...]
    notes: tuple[str, ...] = field(default=())

    def __getitem__(self, name: str) -> PatchOutcome:
        for outcome in self.outcomes:
            if outcome.name == name:
                return outcome
        raise KeyError(name)

    @property
    def kind_text(self) -> str:
        """ "sft trainer", "grpo trainer", or "Trainer" for a plain transformers Trainer (not "trainer trainer")."""
        return "Trainer" if self.trainer_kind == "trainer" else f"{self.trainer_kind} trainer"

    @property
    def applied(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outcomes if o.status is Status.APPLIED)

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outcomes if o.status is Status.SKIPPED)

    def with_outcome(self, outcome: PatchOutcome) -> PatchReport:
        outcomes = tuple(outcome if o.name == outcome.name else o for o in self.outcomes)
        return dataclasses.replace(self, outcomes=outcomes)

    def with_note(self, note: str) -> PatchReport:
        return dataclasses.replace(self, notes=(*self.notes, note))

    def summary(self) -> str:
        parts = [f"{o.name}={o.status.value}" for o in self.outcomes]
        return f"leantrain ({self.kind_text}): " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trainer_kind": self.trainer_kind,
            "outcomes": [o.to_dict() for o in self.outcomes],
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        return self.render()

    def render(self, width: int = WIDTH) -> str:
        """The table, each line at most ``width`` characters: a long reason continues on the next lines, indented
        under the reason column (``MIN_REASON`` wide at least); notes continue indented under their text."""
        rows = [("optimization", "status", "source", "reason")]
        for o in self.outcomes:
            why = "; ".join(o.reasons) or o.detail
            if o.targets and o.status is Status.APPLIED:
                count = f"{len(o.targets)} target{'s' if len(o.targets) != 1 else ''}"
                why = f"{why} ({count})" if why else count
            rows.append((o.name, o.status.value, o.source, why))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        indent = " " * (sum(widths) + 2 * len(widths))
        reason_width = max(width - len(indent), MIN_REASON)
        lines = [f"leantrain patch report ({self.kind_text})"]
        for i, row in enumerate(rows):
            first, *rest = _wrapped(row[3], reason_width)
            lines.append(("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + first).rstrip())
            lines.extend(indent + part for part in rest)
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
        for note in self.notes:
            first, *rest = _wrapped(note, max(width - len("note: "), MIN_REASON))
            lines.append(f"note: {first}")
            lines.extend(" " * len("note: ") + part for part in rest)
        return "\n".join(lines)
