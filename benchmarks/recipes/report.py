"""Rows, table, notes, markdown, plot and merge of the recipes' records (recipes.{json,md,png})."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _harness import Row, markdown_table, stacked_bar_panels, write_results

from .runner import NAME, PARTS, RECIPES, SHORT, gib, log, summary


def timed_steps(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [st for st in config.get("steps") or [] if not st["warmup"]]


def outside_generation(step: dict[str, Any]) -> float:
    return step["total_ms"] - step["parts"].get("generation", 0.0)


def without_generation(config: dict[str, Any]) -> float | None:
    """Median over the timed steps of step time minus generation (what the log-prob kernels can change), or None
    for recipes that do not generate. Generation is launch-bound decoding with a wide per-step spread (see notes)."""
    steps = timed_steps(config)
    if not steps or not any(st["parts"].get("generation", 0.0) > 0 for st in steps):
        return None
    return statistics.median(outside_generation(st) for st in steps)


def first_step_ms(config: dict[str, Any]) -> float:
    """The first step's time (warm-up: compiles, kernel caches, allocator growth land there)."""
    return config["steps"][0]["total_ms"]


def to_rows(rec: dict[str, Any]) -> list[Row]:
    ident = dict(
        recipe=rec["recipe"],
        variant=rec["variant"],
        kind=rec["kind"],
        baseline=rec["baseline"],
        settings=rec["settings"],
    )
    where = (NAME, rec["variant"], rec["recipe"])
    if rec["status"] != "ok":
        config = {**ident, **{k: rec.get(k) for k in ("peak_gib", "base_gib", "wall_s", "extra")}}
        return [Row(*where, rec["status"], rec["reason"], "config", rec["config"], 0.0, config=config)]
    sm = summary(rec)
    keep = (
        "warmup",
        "steps",
        "losses",
        "final_loss",
        "peak_gib",
        "base_gib",
        "build_s",
        "patch_s",
        "train_s",
        "wall_s",
        "extra",
        "metrics",
        "report",
        "timing",
    )
    config = {
        **ident,
        **{k: rec.get(k) for k in keep},
        "parts_ms": sm["parts"],
        "tokens_per_step": sm["tokens_per_step"],
        "tokens_per_s": sm["tokens_per_s"],
        "first_step_ms": first_step_ms(rec),
    }
    return [
        Row(*where, "speed", "ms/step", "config", rec["config"], sm["p50"], sm["p20"], sm["p80"], config=config),
        Row(*where, "throughput", "tokens/s", "config", rec["config"], sm["tokens_per_s"]),
        Row(*where, "memory", "GiB peak above start", "config", rec["config"], rec.get("peak_gib") or float("nan")),
        Row(*where, "quality", "final loss", "config", rec["config"], rec["final_loss"]),
    ]


def main_rows(rows: Sequence[Row]) -> list[Row]:
    """One row per variant: the speed row, or the status row (oom / skipped / failed)."""
    return [r for r in rows if r.benchmark == NAME and r.metric not in ("throughput", "memory", "quality")]


def ms(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def split_text(parts: dict[str, float], total: float) -> str:
    return ", ".join(f"{SHORT[p]} {ms(v)}" for p, v in parts.items() if abs(v) >= 0.005 * total)


def find(rows: Sequence[Row], recipe: str, config: Any, variant: str | None) -> Row | None:
    return next((r for r in rows if r.mode == recipe and r.x_value == config and r.provider == variant), None)


def table(rows: Sequence[Row]) -> str:
    main = main_rows(rows)
    devices = sorted({r.device for r in main})
    header = [
        "recipe",
        "config",
        "variant",
        "step ms (p50)",
        "first step ms",
        "split ms (p50)",
        "tokens/s",
        "peak GiB",
        "final loss",
        "vs stock",
    ]
    generating = any(r.metric == "speed" and without_generation(r.config) is not None for r in main)
    header += ["without generation ms (p50), vs stock"] if generating else []
    timed = any(r.config.get("timing") for r in main)
    header += ["timed"] if timed else []
    projected = {id(r): cell for r, cell in memory_projection(main)}
    header += [PROJECTION_HEADER] if projected else []
    header += ["device"] if len(devices) > 1 else []
    body = []
    for r in main:
        c = r.config
        if r.metric != "speed":
            cells = [r.mode, r.x_value, r.provider, r.metric, "", r.unit, "", gib(c.get("peak_gib")), "", ""]
            cells += [""] if generating else []
        else:
            base = find(main, r.mode, r.x_value, c.get("baseline"))
            ratio = (
                "1"
                if c.get("baseline") is None
                else (f"{base.p50 / r.p50:.3f}x" if base is not None and base.metric == "speed" else "n/a")
            )
            loss = c.get("final_loss")
            cells = [
                r.mode,
                r.x_value,
                r.provider,
                ms(r.p50),
                ms(first_step_ms(c)),
                split_text(c["parts_ms"], r.p50),
                f"{c['tokens_per_s']:.0f}",
                gib(c.get("peak_gib")),
                "n/a" if loss is None else f"{loss:.5g}",
                ratio,
            ]
            if generating:
                cells.append(_without_generation_cell(r, base))
        cells += [c.get("timing") or ""] if timed else []
        cells += [projected.get(id(r), "")] if projected else []
        body.append(cells + ([r.device] if len(devices) > 1 else []))
    return markdown_table(header, body)


PROJECTION_HEADER = "peak GiB per layer -> whole model (vs a 24 GiB card)"
CARD_GIB = 24.0


def memory_projection(main: Sequence[Row]) -> list[tuple[Row, str]]:
    """Rows of a recipe built at several layer counts (settings ``layers`` of ``full_layers``): per-layer peak =
    the slope between the two largest counts of the same variant; whole model = the largest count's peak plus the
    missing layers at that slope (embeddings, head and logits are in the intercept, so they are counted once)."""
    out = []
    for r in main:
        st = r.config.get("settings") or {}
        if r.metric != "speed" or "full_layers" not in st or r.config.get("peak_gib") is None:
            continue
        same = [
            (o.config["settings"]["layers"], o.config["peak_gib"])
            for o in main
            if o.mode == r.mode
            and o.provider == r.provider
            and o.metric == "speed"
            and o.config.get("peak_gib") is not None
            and (o.config.get("settings") or {}).get("full_layers") == st["full_layers"]
        ]
        points = sorted(dict(same).items())
        if len(points) < 2 or st["layers"] != points[-1][0]:
            continue
        (l1, p1), (l2, p2) = points[-2], points[-1]
        per_layer = (p2 - p1) / (l2 - l1)
        whole = p2 + (st["full_layers"] - l2) * per_layer
        fits = "fits" if whole <= CARD_GIB else "does not fit"
        out.append((r, f"{per_layer:.2f} -> {whole:.1f} at {st['full_layers']} layers ({fits} {CARD_GIB:.0f} GiB)"))
    return out


def _without_generation_cell(r: Row, base: Row | None) -> str:
    mine = without_generation(r.config)
    if mine is None:
        return ""
    theirs = without_generation(base.config) if base is not None and base.metric == "speed" else None
    if r.config.get("baseline") is None:
        return f"{ms(mine)} (1)"
    return f"{ms(mine)} ({theirs / mine:.2f}x)" if theirs is not None else f"{ms(mine)} (n/a)"


def differences(rows: Sequence[Row], threshold: float = 0.02) -> list[str]:
    """Every leantrain / peer variant against its baseline: the step change, each part whose change exceeds
    ``threshold`` of the baseline step, the losses, and for GRPO whether the completions were the same."""
    main = main_rows(rows)
    lines = []
    for r in main:
        c = r.config
        base = find(main, r.mode, r.x_value, c.get("baseline")) if c.get("baseline") else None
        if r.metric != "speed" or base is None or base.metric != "speed":
            continue
        b = base.config
        change = r.p50 / base.p50 - 1
        flag = "" if abs(change) <= threshold else " (above 2%)"
        parts = [
            f"{p} {ms(b['parts_ms'][p])} -> {ms(c['parts_ms'][p])} ms"
            f" ({(c['parts_ms'][p] - b['parts_ms'][p]) / base.p50:+.1%} of the step)"
            for p in PARTS
            if abs(c["parts_ms"][p] - b["parts_ms"][p]) > threshold * base.p50
        ]
        text = (
            f"- {r.mode} {r.x_value}, {r.provider} vs {base.provider}: {ms(base.p50)} -> {ms(r.p50)} ms/step "
            f"({change:+.1%}){flag}"
        )
        text += "; " + "; ".join(parts) if parts else "; no part moved by more than 2% of the step"
        mine, theirs = without_generation(c), without_generation(b)
        if mine is not None and theirs is not None:
            text += f"; without generation {ms(theirs)} -> {ms(mine)} ms ({theirs / mine:.2f}x)"
        text += f"; final loss {b.get('final_loss'):.5g} -> {c.get('final_loss'):.5g}"
        same = completions_match(base, r)
        if same:
            text += f"; {same}"
        lines.append(text)
    return lines


def completions_match(a: Row, b: Row) -> str:
    """GRPO: which steps produced identical completions (hash of the token ids) and equal token counts."""
    steps_a, steps_b = a.config.get("steps") or [], b.config.get("steps") or []
    pairs = [(x, y) for x, y in zip(steps_a, steps_b) if "completion_hash" in x and "completion_hash" in y]
    if not pairs:
        return ""
    same = sum(x["completion_hash"] == y["completion_hash"] for x, y in pairs)
    lengths = sum(x["completion_tokens"] == y["completion_tokens"] for x, y in pairs)
    tokens = "/".join(str(x["completion_tokens"]) for x, _ in pairs)
    return (
        f"completions identical in {same}/{len(pairs)} steps, equal completion tokens in {lengths}/"
        f"{len(pairs)} (stock per step: {tokens})"
    )


def warmup_spikes(config: dict[str, Any], factor: float = 3.0) -> list[str]:
    """Timed steps whose time outside generation exceeds ``factor`` x the variant's median: a one-time warm-up
    (a new sequence length, a recompile) that the priming round did not absorb; the medians include it."""
    steps = timed_steps(config)
    rest = [outside_generation(st) for st in steps]
    if len(rest) < 3:
        return []
    typical = statistics.median(rest)
    return [
        f"step {st['step']} took {ms(r)} ms outside generation ({r / typical:.1f}x the median: a one-time warm-up)"
        for st, r in zip(steps, rest)
        if r > factor * typical
    ]


def per_order(config: dict[str, Any]) -> list[str]:
    """Steps merged from both orders (runner.run_both_orders): each order's median step, so an order effect shows."""
    steps = timed_steps(config)
    orders = sorted({st["order"] for st in steps if "order" in st})
    if len(orders) < 2:
        return []
    medians = [statistics.median(st["total_ms"] for st in steps if st.get("order") == k) for k in orders]
    return ["step p50 per order " + " / ".join(ms(m) for m in medians) + " ms (first order, then the other)"]


def notes(rows: Sequence[Row]) -> list[str]:
    out = []
    for r in main_rows(rows):
        c = r.config
        extra, metrics = c.get("extra") or {}, c.get("metrics") or {}
        bits = []
        if "build_model_s" in extra:
            bits.append(
                f"model build {extra['build_model_s']:.1f} s ({extra['layout']}, "
                f"{gib(extra['model_gib'])} GiB, experts {extra['experts_implementation']})"
            )
        if c.get("patch_s") is not None:
            bits.append(f"patch_trainer {c['patch_s']:.1f} s")
        bits += warmup_spikes(c)
        bits += per_order(c)
        if "expert_lora_params" in extra:
            count, numel = extra["expert_lora_params"], extra["expert_lora_numel"]
            bits.append(f"LoRA on experts: {count} adapter tensors ({numel:,} values)")
        gen = [st["parts"].get("generation", 0.0) / 1e3 for st in timed_steps(c)]
        if any(gen):
            bits.append(f"generation per timed step {min(gen):.1f}-{max(gen):.1f} s")
        if "cggr/kept_fraction" in metrics:
            kept = metrics["cggr/kept_fraction"]
            bits.append(f"CGGR kept fraction {min(kept):.3f}-{max(kept):.3f}")
        report = c.get("report")
        if report:
            applied = [o["name"] for o in report["outcomes"] if o["status"] == "applied"]
            bits.append(f"applied: {', '.join(applied) or 'nothing'}")
        if bits:
            out.append(f"- {r.mode} {r.x_value}, {r.provider}: " + "; ".join(bits))
    return out


TIMED_TEXT = (
    " Timed: primed = every variant ran all its steps once untimed first (per-length attention plans and kernel "
    "caches warm); both orders = the pair ran stock first and then leantrain first in the same process, and its "
    "medians run over the timed steps of both runs, so neither variant is the one that meets first-time costs "
    "(comparable); GRPO rows without it come from runs before this rule (one order, possibly not comparable)."
)


def sources(rows: Sequence[Row]) -> list[str]:
    """One line per recipe and run that measured it: device, date, commit."""
    seen: dict[tuple[str, str, str, str], None] = {}
    for r in rows:
        seen.setdefault((r.mode, r.device, r.date[:10], r.commit))
    return [f"- {recipe}: {device}, {date}, commit {commit}" for recipe, device, date, commit in seen]


def markdown(rows: Sequence[Row]) -> str:
    text = (
        "What `patch_trainer` changes in a training step, measured: random-init public shapes (real vocab sizes), "
        "stock and leantrain in one process, seeded, medians over the timed steps after warm-up. Split: exclusive "
        "time in the trainer's own methods (see benchmarks/bench_recipes.py); peak = CUDA memory allocated above "
        "what was allocated before the variant was built; vs stock = baseline step time / this step time."
        + (TIMED_TEXT if any(r.config.get("timing") for r in main_rows(rows)) else "")
        + "\n\n"
        + table(rows)
    )
    text += "\n\nMeasured (the header above names the first row's):\n\n" + "\n".join(sources(rows))
    diffs, extra = differences(rows), notes(rows)
    if diffs:
        text += "\n\nDifferences (parts that moved by more than 2% of the baseline step):\n\n" + "\n".join(diffs)
    if extra:
        text += "\n\nNotes:\n\n" + "\n".join(extra)
    return text


def plot(rows: Sequence[Row], path: Path) -> None:
    """One panel per (recipe, config), a bar per variant, the split stacked; panels wrap into rows."""
    main = main_rows(rows)
    panels: dict[str, dict[str, dict[str, float]]] = {}
    for r in main:
        label = r.provider + ("" if r.metric == "speed" else f" ({r.metric})")
        values = r.config["parts_ms"] if r.metric == "speed" else {}
        panels.setdefault(f"{r.mode}: {r.x_value}", {})[label] = {p: max(0.0, v) / 1e3 for p, v in values.items()}
        if values.get("generation", 0.0) > 0:  # generation hides the rest: the same bars again without it
            rest = panels.setdefault(f"{r.mode}: {r.x_value}, without generation", {})
            rest[label] = {p: max(0.0, v) / 1e3 for p, v in values.items() if p != "generation"}
    title = "Training step time per recipe, stock vs leantrain (s, lower is better)"
    stacked_bar_panels(path, title, panels, PARTS, "s / step")


def write_all(rows: list[Row], out_dir: Path) -> None:
    order = {name: i for i, name in enumerate(RECIPES)}
    rows = sorted(rows, key=lambda r: order.get(r.mode, len(order)))  # stable: run order kept within a recipe
    write_results(NAME, rows, markdown(rows), out_dir)
    plot(rows, out_dir / f"{NAME}.png")
    log(f"wrote {out_dir / NAME}.json/.md/.png ({len(main_rows(rows))} variants)")


def merge(old: Sequence[Row], new: Sequence[Row]) -> list[Row]:
    """Old rows of the (recipe, config) pairs not in ``new``, then ``new`` (a run of one grpo shape keeps the
    other shape's rows)."""
    ran = {(r.mode, r.x_value) for r in new}
    return [r for r in old if (r.mode, r.x_value) not in ran] + list(new)
