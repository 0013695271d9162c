"""Measured evidence: the one record behind every verdict an optimization takes from a measurement, and the two
constants every measured rule shares (what counts as noise, how far a measurement reaches).

Plain values: the optimizations' rule tables (``fused_ce/dispatch.py``, ``grpo_logps/nograd.py``,
``grpo_logps/measured.py``, ``layer_kernels/families.py``, ``compile_layers/measured.py``, ``moe4bit/recompute.py``,
``moe4bit/measured.py``) hold :class:`Evidence` records, and their probes quote them. A default is what was measured
faster on this device class and shape: where a probe's evidence says leantrain's path is slower, or nothing measured
it faster here, it answers ``Readiness.slower(evidence)`` (beside any blocker: ``with_auto_rule``) and the entry point
decides: skipped in auto mode, applied when asked for."""

from __future__ import annotations

from dataclasses import dataclass


# Median-to-median differences below this share are timing noise (p20-p80 spreads of 1-3% on an H100).
NOISE = 0.03
# A measurement speaks for shapes within this factor (in each measured dimension) of the measured ones.
REACH = 2.0


def beyond_noise(ours_ms: float, theirs_ms: float) -> bool:
    """Whether ``ours`` was faster than ``theirs`` beyond the noise. A tie goes to ``theirs``: no default slower than
    the path it replaces, and a verdict that flips inside the noise would make a rule depend on the shape."""
    return ours_ms < theirs_ms * (1 - NOISE)


@dataclass(frozen=True)
class Evidence:
    """What a verdict rests on: the verdict, the device and date it was measured on, and the detail the report
    quotes (shape, setup, times, or the results file and commit)."""

    verdict: str  # e.g. "faster", "not faster", "recompute", "the stock head"
    device: str
    date: str  # YYYY-MM-DD
    detail: str

    @property
    def faster(self) -> bool:
        """Whether leantrain's path measured faster (the verdict ``"faster"``)."""
        return self.verdict == "faster"

    @classmethod
    def parse(cls, verdict: str, source: str) -> Evidence:
        """From a ``"device, date, detail"`` line (what the benchmarks' ``--emit-rule`` prints as ``SOURCE``)."""
        device, date, detail = (part.strip() for part in source.split(",", 2))
        return cls(verdict, device, date, detail)

    def __str__(self) -> str:
        return f"{self.device}, {self.date}, {self.detail}"
