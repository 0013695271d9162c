"""Rows and a markdown table for ``gpu_dist.sh``: recipes (dense LoRA SFT, full SFT, GRPO, MoE QLoRA, OSFT, CGGR)
under DDP, FSDP2, ZeRO-2 and ZeRO-3, stock vs leantrain.

Input: the per-rank JSON files the example scripts write (``examples/_common.py``), one directory per run named
``<recipe>.<engine>.<variant>`` (variant ``stock`` = ``LEANTRAIN_DISABLE=1``, or ``leantrain``). Output, into
``--out`` (default ``benchmarks/results/distributed``): ``dist_<device>_<date>_<commit>.json`` (one row per run:
step time, tokens/s per GPU, peak memory per rank, applied / declined / failed optimizations with reasons, loss and
KL agreement with the stock run of the same recipe and engine) and the same name ``.md`` (device, versions, date,
commit, the table). The opt-in recipes (``OPT_IN``: they change what trains) have no stock launch of their own: they
are compared with the stock run of the recipe they modify, and their loss difference is a measurement, not a bound.
A ``launches.tsv`` beside the run directories (written by ``gpu_dist.sh``) adds a row for every launch that failed
or was skipped without leaving rank rows, with its reason.

    python3 benchmarks/dist_table.py /tmp/d1 [/tmp/d2 ...] --out benchmarks/results/distributed
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
from pathlib import Path
from typing import Any


RESULTS = Path(__file__).resolve().parent / "results" / "distributed"
VARIANTS = ("stock", "leantrain")
# opt-in recipe -> the recipe whose stock run is its baseline (same script, shape and steps without the opt-in)
OPT_IN = {"osft": "sft_full", "cggr": "sft_full"}
RUN_NAME = re.compile(r"^(?P<recipe>[a-z0-9_]+)\.(?P<engine>[a-z0-9_]+)\.(?P<variant>stock|leantrain)$")


def parse_run(name: str) -> tuple[str, str, str] | None:
    """(recipe, engine, variant) of a run directory name, or None for anything else."""
    match = RUN_NAME.match(name)
    return (match["recipe"], match["engine"], match["variant"]) if match else None


def load(root: Path) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """{(recipe, engine, variant): [rank rows sorted by rank]} of every run directory under ``root``."""
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for path in sorted(Path(root).glob("*/*_rank*.json")):
        key = parse_run(path.parent.name)
        if key is not None:
            runs.setdefault(key, []).append(json.loads(path.read_text()))
    return {key: sorted(rows, key=lambda r: r["rank"]) for key, rows in runs.items()}


def _outcomes(rank0: dict[str, Any]) -> dict[str, list[str]]:
    """{status: ["name: reason", ...]} from rank 0's patch report (every rank runs the same probes)."""
    grouped: dict[str, list[str]] = {}
    for outcome in (rank0.get("report") or {}).get("outcomes", []):
        reasons = "; ".join(outcome.get("reasons") or ())
        entry = f"{outcome['name']}: {reasons}" if reasons else outcome["name"]
        grouped.setdefault(outcome["status"], []).append(entry)
    return grouped


def _max_rel_diff(got: list[float], ref: list[float]) -> float | None:
    """max_i |got_i - ref_i| / max(|ref_i|, 1e-12) over the common steps; None when there is nothing to compare."""
    pairs = list(zip(got, ref))
    if not pairs:
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def _max_abs_diff(got: list[float], ref: list[float]) -> float | None:
    pairs = list(zip(got, ref))
    return max(abs(a - b) for a, b in pairs) if pairs else None


def summarize(runs: dict[tuple[str, str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run. Step time: the slowest rank's median (the ranks wait for each other); tokens/s per GPU:
    the global token count / world / steps / that step time; loss and KL agreement: rank 0's logged values against
    the stock run of the same recipe and engine (ranks log the same gathered values)."""
    rows = []
    for (recipe, engine, variant), ranks in sorted(runs.items()):
        rank0 = ranks[0]
        world = int(rank0.get("world_size") or len(ranks))
        step_ms = max((r["step_ms_p50"] for r in ranks if r.get("step_ms_p50") is not None), default=None)
        steps = int(rank0.get("steps") or len(rank0.get("losses") or ()) or 0)
        tokens = int(rank0.get("num_tokens") or 0)
        per_gpu = tokens / world / steps / (step_ms / 1e3) if tokens and steps and step_ms else None
        outcomes = _outcomes(rank0)
        row: dict[str, Any] = {
            "recipe": recipe,
            "engine": engine,
            "variant": variant,
            "world_size": world,
            "ranks_reported": len(ranks),
            "distributed": rank0.get("distributed"),
            "device": rank0.get("device"),
            "versions": rank0.get("versions"),  # what the run trained with (examples/_common.py)
            "step_ms_p50": step_ms,
            "tokens_per_s_per_gpu": per_gpu,
            "peak_gib_per_rank": [r.get("peak_gib") for r in ranks],
            "applied": outcomes.get("applied", []),
            "declined": outcomes.get("skipped", []),
            "failed": outcomes.get("failed", []),
            "losses": rank0.get("losses") or [],
            "kl": rank0.get("kl") or [],
            "loss_max_rel_diff_vs_stock": None,
            "kl_max_abs_diff_vs_stock": None,
        }
        stock = runs.get((OPT_IN.get(recipe, recipe), engine, "stock"))
        if variant != "stock" and stock:
            row["stock_run"] = f"{OPT_IN.get(recipe, recipe)}.{engine}.stock"
            row["loss_max_rel_diff_vs_stock"] = _max_rel_diff(row["losses"], stock[0].get("losses") or [])
            row["kl_max_abs_diff_vs_stock"] = _max_abs_diff(row["kl"], stock[0].get("kl") or [])
            row["step_ratio_vs_stock"] = _ratio(stock, step_ms)
            row["loss_within_bound"] = None if recipe in OPT_IN else _within_bound(row, stock[0])
        rows.append(row)
    return rows


def _within_bound(row: dict[str, Any], stock0: dict[str, Any]) -> bool | None:
    """Every step's |loss - stock loss| within ``leantrain compare``'s bound (``compare.loss_bounds``: a few unit
    roundoffs of the run's dtype per rounding depth of its layers, propagated along the loss's movement); None when
    there is nothing to compare or leantrain is not importable."""
    try:
        from leantrain.cli.verdict import loss_bounds
    except ImportError:
        return None
    ref = stock0.get("losses") or []
    if not row["losses"] or not ref:
        return None
    bounds = loss_bounds(ref, stock0.get("dtype") or "bf16", stock0.get("layers"))
    return all(b is None or abs(a - r) <= b for a, r, b in zip(row["losses"], ref, bounds))


def _ratio(stock: list[dict[str, Any]], step_ms: float | None) -> float | None:
    """stock's step time / this run's (slowest ranks): > 1 means faster than stock."""
    ref = max((r["step_ms_p50"] for r in stock if r.get("step_ms_p50") is not None), default=None)
    return ref / step_ms if ref and step_ms else None


def launch_rows(root: Path, have: set[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """A row for each launch in ``root/launches.tsv`` that left no rank rows: failed (rc, last error line), timed
    out or skipped (time budget)."""
    path = Path(root) / "launches.tsv"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines()[1:]:
        name, rc, secs, why = (line.split("\t") + ["", "", ""])[:4]
        key = parse_run(name)
        if key is None or key in have or rc == "0":
            continue
        state = "skipped" if rc == "skipped" else f"launch failed (rc {rc})"
        recipe, engine, variant = key
        rows.append(
            {
                "recipe": recipe,
                "engine": engine,
                "variant": variant,
                "world_size": None,
                "ranks_reported": 0,
                "step_ms_p50": None,
                "tokens_per_s_per_gpu": None,
                "peak_gib_per_rank": [],
                "applied": [],
                "declined": [],
                "failed": [f"{state}: {why}" if why else state],
                "losses": [],
                "kl": [],
                "loss_max_rel_diff_vs_stock": None,
                "kl_max_abs_diff_vs_stock": None,
                "seconds": secs,
            }
        )
    return rows


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    return format(value, spec)


# Declines that only say the optimization is not for this kind of recipe (kept in the JSON rows, left out of the table)
NOT_FOR_RECIPE = ("does not apply to ", "has no MoE experts")


def _loss(r: dict[str, Any]) -> str:
    within = {True: " (yes)", False: " (NO)", None: ""}[r.get("loss_within_bound")]
    return _fmt(r["loss_max_rel_diff_vs_stock"], ".2e") + within


def markdown(rows: list[dict[str, Any]]) -> str:
    header = (
        "| recipe | engine | variant | step ms (p50, slowest rank) | speed-up vs stock | tokens/s per GPU | "
        "peak GiB per rank | loss max rel diff vs stock (within bound) | KL max abs diff vs stock | applied | "
        "declined / failed (why) |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in rows:
        peaks = ", ".join(_fmt(p, ".2f") for p in r["peak_gib_per_rank"]) or "—"
        declined = [d for d in r["declined"] if not any(phrase in d for phrase in NOT_FOR_RECIPE)]
        why = "<br>".join(declined + [f"FAILED {f}" for f in r["failed"]]) or "—"
        lines.append(
            f"| {r['recipe']} | {r['engine']} | {r['variant']} | {_fmt(r['step_ms_p50'], '.1f')} | "
            f"{_fmt(r.get('step_ratio_vs_stock'), '.2f')} | {_fmt(r['tokens_per_s_per_gpu'], ',.0f')} | {peaks} | "
            f"{_loss(r)} | "
            f"{_fmt(r['kl_max_abs_diff_vs_stock'], '.2e')} | {', '.join(r['applied']) or '—'} | {why} |"
        )
    return "\n".join(lines)


NOTES = (
    "Each row is its own `accelerate launch` (one process per GPU). Speed-up: the stock run's step time over this "
    "run's, both the slowest rank's median after 2 warm-up steps. osft and cggr are opt-in (they change what "
    "trains): their baseline is sft_full's stock run, and their loss difference is a measurement, not a bound. "
    "Loss within bound: every step's difference from stock within the bound `leantrain compare` derives (unit "
    "roundoff of the dtype times the rounding depth of the layers, propagated along the loss's movement)."
)


def write(rows: list[dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """``<stem>.json`` ({meta, rows}) and ``<stem>.md`` under ``out_dir``; the stem names device, date and commit."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^A-Za-z0-9]+", "-", str(meta.get("device") or "unknown")).strip("-").lower()
    stem = f"dist_{device}_{str(meta['date'])[:10]}_{meta['commit']}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items())
    md_path.write_text(
        f"# Distributed recipes: stock vs leantrain\n\nDevice: {meta.get('device')} x {meta.get('world_size')}. "
        f"Date: {meta['date']}. Commit: {meta['commit']}.\nVersions: {versions}.\n\n{markdown(rows)}\n\n{NOTES}\n"
    )
    return json_path, md_path


DOCS_BEGIN, DOCS_END = "<!-- dist-table:begin -->", "<!-- dist-table:end -->"


def into_docs(page: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Replace what is between ``page``'s markers with the setting line, the table and its notes."""
    text = page.read_text()
    if DOCS_BEGIN not in text or DOCS_END not in text:
        raise SystemExit(f"dist_table: {page} has no {DOCS_BEGIN} ... {DOCS_END} markers")
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    versions = ", ".join(f"{k} {v}" for k, v in (meta.get("versions") or {}).items() if k != "leantrain")
    body = (
        f"{meta.get('device')} x {meta.get('world_size')}, measured {str(meta['date'])[:10]} ({versions}).\n\n"
        f"{markdown(rows)}\n\n{NOTES}"
    )
    page.write_text(f"{head}{DOCS_BEGIN}\n{body}\n{DOCS_END}{tail}")


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "bitsandbytes", "leantrain"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "roots", type=Path, nargs="+", help="directories holding one sub-directory per run (several calls' runs)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--commit", default=None, help="default: $BENCH_COMMIT or 'unknown'")
    parser.add_argument(
        "--docs", type=Path, default=None, help="also put the table into this page between its markers"
    )
    args = parser.parse_args(argv)
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for root in args.roots:  # a run measured in a later directory replaces an earlier one
        runs.update(load(root))
    failed: dict[tuple[str, str, str], dict[str, Any]] = {}
    for root in args.roots:
        failed.update({(r["recipe"], r["engine"], r["variant"]): r for r in launch_rows(root, set(runs))})
    rows = summarize(runs) + list(failed.values())
    if not rows:
        roots = " ".join(map(str, args.roots))
        print(f"dist_table: no <recipe>.<engine>.<variant>/*_rank*.json (nor launches.tsv) under {roots}")
        return 1
    meta = {
        "device": rows[0].get("device"),  # rank-row runs come first; launch-only rows have none
        "world_size": max(r["world_size"] or 0 for r in rows),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit or os.environ.get("BENCH_COMMIT", "unknown"),
        # the runs' own versions; this machine's only for rows written before the runs recorded them
        "versions": next((r["versions"] for r in rows if r.get("versions")), None) or _versions(),
    }
    json_path, md_path = write(rows, args.out, meta)
    if args.docs is not None:
        into_docs(args.docs, rows, meta)
    print(md_path.read_text())
    print(f"rows: {json_path}\ntable: {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
