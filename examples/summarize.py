"""Summarize the per-rank JSON rows the example scripts write: one markdown table (step time, peak memory, loss)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(root: str) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(Path(root).glob("*/*_rank*.json"))]
    print("| run | engine | rank | world | step ms p50 | peak GiB | first loss | last loss | applied |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path, row in zip(sorted(Path(root).glob("*/*_rank*.json")), rows):
        applied = [o["name"] for o in (row.get("report") or {}).get("outcomes", []) if o["status"] == "applied"]
        losses = row.get("losses") or [float("nan")]
        step = row.get("step_ms_p50") or float("nan")
        peak = row.get("peak_gib") or float("nan")
        print(
            f"| {path.parent.name} | {row['distributed']} | {row['rank']} | {row['world_size']} | {step:.1f} | "
            f"{peak:.2f} | {losses[0]:.3f} | {losses[-1]:.3f} | {', '.join(applied) or '-'} |"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
