"""Which head computes the loss on each TRL path: leantrain's fused op or the loss it would replace, from measurement.

Plain values only. A measured cell (the loss head alone, forward + backward, median ms on one device class) is one
:class:`Measured` row; the kernel benchmark's results give the table below:
``python -m leantrain.fused_ce.dispatch benchmarks/results/fused_ce.json`` prints it
(``emit_rule(measured_from_rows(rows), source)``) to paste here. leantrain's op serves a path at a head shape on a
device class only where every measured N of the nearest measured cell of that device class was faster than what it
replaces beyond the timing noise. Without a measured cell (another device class, another dtype or head, a shape
beyond :data:`REACH`) the stock loss serves: nothing is leantrain's by default that was not measured faster.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from ..measured import NOISE, REACH, Evidence, beyond_noise


# The loss each path replaces: TRL >= 1.15's own fused head, TRL 1.4-1.14's chunked cross-entropy, and the full
# [B, T, V] logits of the model's own loss (TRL <= 1.14 "nll" / "dft", a plain transformers Trainer).
PATHS = ("trl_fused", "chunked_nll", "full_logits")
HEADS = ("frozen", "trainable")
__all__ = [
    "EVIDENCE",
    "FSDP2_EVIDENCE",
    "MEASURED",
    "NOISE",
    "PATHS",
    "REACH",
    "Measured",
    "choose",
    "device_class",
    "device_reason",
    "emit_rule",
    "measured_from_rows",
]
# Cells farther than REACH in H or V from every measured cell count as unmeasured.


# Under FSDP2 the whole training step measured slower with leantrain's op than with the loss it replaces (two
# GPUs, TRL 1.16 SFTTrainer, dense LoRA SFT: benchmarks/results/distributed/), while DDP and ZeRO-2 measured faster
# (414 -> 368 and 559 -> 511 ms): auto mode keeps the stock loss under FSDP2 until a measurement says otherwise.
FSDP2_EVIDENCE = Evidence(
    "the stock head",
    "2 x H200",
    "2026-11-27",
    "Qwen2.5-0.5B LoRA SFT under FSDP2, 4 x 512 tokens per GPU: step 470.6 ms stock, 569.6 ms with the fused loss",
)


class Measured(NamedTuple):
    """One measured cell: the loss head's forward + backward at N rows, what the path runs (stock) vs leantrain."""

    path: str
    head: str  # "frozen" or "trainable"
    n: int
    h: int
    v: int
    dtype: str  # the logits tiles' dtype, torch's name without "torch."
    device: str  # the device class it was measured on: torch's device type ("cuda", "cpu")
    stock_ms: float
    leantrain_ms: float

    @property
    def leantrain_wins(self) -> bool:
        # a tie goes to the stock path (no default slower than what it replaces)
        return beyond_noise(self.leantrain_ms, self.stock_ms)


# Filled from a GPU run of benchmarks/bench_fused_ce.py (`--emit-rule`); empty until then.
SOURCE = "NVIDIA H100 80GB HBM3, 2026-11-25, benchmarks/results/fused_ce.json"
MEASURED: tuple[Measured, ...] = (
    Measured("full_logits", "frozen", 8192, 4096, 128256, "bfloat16", "cuda", 41.1071, 30.2835),
    Measured("full_logits", "frozen", 8192, 1536, 151936, "bfloat16", "cuda", 31.2743, 16.7525),
    Measured("full_logits", "frozen", 8192, 2304, 256000, "bfloat16", "cuda", 61.0408, 35.8812),
    Measured("full_logits", "trainable", 8192, 4096, 128256, "bfloat16", "cuda", 52.8692, 46.0716),
    Measured("full_logits", "trainable", 8192, 1536, 151936, "bfloat16", "cuda", 36.2759, 24.3544),
    Measured("full_logits", "trainable", 8192, 2304, 256000, "bfloat16", "cuda", 74.5816, 54.4897),
    Measured("trl_fused", "frozen", 8192, 4096, 128256, "bfloat16", "cuda", 43.5787, 30.2835),
    Measured("trl_fused", "frozen", 8192, 1536, 151936, "bfloat16", "cuda", 22.6633, 16.7525),
    Measured("trl_fused", "frozen", 8192, 2304, 256000, "bfloat16", "cuda", 51.3019, 35.8812),
    Measured("trl_fused", "trainable", 8192, 4096, 128256, "bfloat16", "cuda", 58.5232, 46.0716),
    Measured("trl_fused", "trainable", 8192, 1536, 151936, "bfloat16", "cuda", 29.3507, 24.3544),
    Measured("trl_fused", "trainable", 8192, 2304, 256000, "bfloat16", "cuda", 69.7181, 54.4897),
)
EVIDENCE = Evidence.parse("per cell: leantrain's op where faster at every N beyond the noise", SOURCE)


def choose(
    path: str, head: str, h: int, v: int, dtype: str, measured: Iterable[Measured] | None = None, *, device: str
) -> tuple[str, str]:
    """("leantrain" or "stock", why) for one head shape on one path on a device class (torch's device type)."""
    if path not in PATHS or head not in HEADS:
        raise ValueError(f"unknown path {path!r} or head {head!r}: expected one of {PATHS} and {HEADS}")
    table = tuple(MEASURED if measured is None else measured)
    elsewhere = device_reason(device, table)
    if elsewhere:
        return "stock", elsewhere
    rows = [m for m in table if (m.path, m.head, m.dtype, m.device) == (path, head, dtype, device)]
    near = [m for m in rows if max(_ratio(m.h, h), _ratio(m.v, v)) <= REACH]
    if not near:
        return "stock", f"not measured at H={h} V={v} {dtype} {head} head on {device}: {_who('stock')}"
    cell = min(near, key=lambda m: abs(math.log(m.h / h)) + abs(math.log(m.v / v)))
    points = [m for m in near if (m.h, m.v) == (cell.h, cell.v)]
    verdict = "leantrain" if all(m.leantrain_wins for m in points) else "stock"
    ns = "/".join(str(m.n) for m in sorted(points))
    return verdict, f"measured at H={cell.h} V={cell.v} {dtype} on {device}, N {ns} ({EVIDENCE}): {_who(verdict)}"


def device_reason(device: str, measured: Iterable[Measured] | None = None) -> str | None:
    """Why no cell speaks for ``device`` (a device class: torch's device type), or None when some cell does: a
    measurement on one device class never decides for another."""
    table = tuple(MEASURED if measured is None else measured)
    if any(m.device == device for m in table):
        return None
    where = ", ".join(sorted({m.device for m in table}))
    measured_on = f"measured on {where} only: {EVIDENCE}" if where else "no measured cell"
    return f"not measured on {device} ({measured_on}): {_who('stock')}"


def _ratio(a: int, b: int) -> float:
    return max(a, b) / max(1, min(a, b))


def _who(verdict: str) -> str:
    return "leantrain's op" if verdict == "leantrain" else "the stock loss"


# ---------------------------------------------------------------------------------------- from benchmark rows
STOCK_PROVIDERS = {"trl_fused": "trl_fused", "chunked_nll": "trl_chunked", "full_logits": "stock"}


def measured_from_rows(rows: Iterable[Mapping]) -> list[Measured]:
    """The rule's cells from the kernel benchmark's speed rows (dicts of ``benchmarks._harness.Row`` fields).

    A row counts when ``metric == "speed"`` and its ``config`` holds ``N``, ``H``, ``V``, ``dtype`` (``"bfloat16"`` or
    ``"torch.bfloat16"``) and the head (``head``: "frozen" / "trainable", or ``trainable_head``: a bool); its
    ``provider`` is ``"leantrain"`` or the stock provider of a path (:data:`STOCK_PROVIDERS`), its ``device`` the
    device's name (:func:`device_class`). Each stock provider's cell pairs with leantrain's cell of the same
    (N, H, V, dtype, head, device class)."""
    times: dict[tuple, dict[str, float]] = {}
    for row in rows:
        config = row.get("config") or {}
        head = config.get("head", {True: "trainable", False: "frozen"}.get(config.get("trainable_head")))
        if row.get("metric") != "speed" or head is None or not all(k in config for k in ("N", "H", "V", "dtype")):
            continue
        dtype = str(config["dtype"]).removeprefix("torch.")
        key = (head, int(config["N"]), int(config["H"]), int(config["V"]), dtype, device_class(row))
        times.setdefault(key, {})[str(row["provider"])] = float(row["p50"])
    cells = []
    for (head, n, h, v, dtype, device), by_provider in sorted(times.items()):
        if "leantrain" not in by_provider:
            continue
        for path, provider in STOCK_PROVIDERS.items():
            if provider in by_provider:
                ours, theirs = round(by_provider["leantrain"], 4), round(by_provider[provider], 4)
                cells.append(Measured(path, head, n, h, v, dtype, device, theirs, ours))
    return cells


def device_class(row: Mapping) -> str:
    """A benchmark row's device class (torch's device type): the benchmarks name a CPU ``cpu (...)`` and a GPU by
    its CUDA name; a row without a device cannot say where it was measured."""
    name = row.get("device")
    if not name:
        raise ValueError(f"a benchmark row without a device: {dict(row)}")
    return "cpu" if str(name).startswith("cpu") else "cuda"


def emit_rule(cells: Iterable[Measured], source: str) -> str:
    """Python source of ``SOURCE`` / ``MEASURED`` for this module (what the benchmark's ``--emit-rule`` prints)."""
    lines = [f"SOURCE = {json.dumps(source)}", "MEASURED: tuple[Measured, ...] = ("]
    for m in sorted(cells, key=lambda m: (m.device, m.path, m.head, m.v, m.h, m.dtype, m.n)):
        lines.append(
            f'    Measured("{m.path}", "{m.head}", {m.n}, {m.h}, {m.v}, "{m.dtype}", "{m.device}", {m.stock_ms}, '
            f"{m.leantrain_ms}),"
        )
    lines.append(")")
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    """``python -m leantrain.fused_ce.dispatch RESULTS.json``: the rule's table from the kernel benchmark's rows."""
    if len(argv) != 1:
        print("usage: python -m leantrain.fused_ce.dispatch benchmarks/results/fused_ce.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        rows = json.load(f)
    cells = measured_from_rows(rows)
    if not cells:
        print(f"no leantrain / stock speed pairs in {argv[0]}", file=sys.stderr)
        return 1
    first = next(r for r in rows if r.get("provider") == "leantrain")
    # the results file, not its commit: the report's wording reaches the docs, which name no commits
    name, date = os.path.basename(argv[0]), str(first.get("date"))[:10]
    source = f"{first.get('device')}, {date}, benchmarks/results/{name}"
    print(emit_rule(cells, source))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
