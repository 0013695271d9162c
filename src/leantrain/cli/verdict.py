"""The statistics and the verdict of a stock-vs-leantrain comparison: step-time spread, peak memory, per-step
losses against a bound derived from the dtype's rounding, and what may be claimed. ``leantrain compare`` and
``leantrain demo`` both conclude with ``verdict``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._measure import Measurement


ORDER = ("stock", "leantrain", "leantrain", "stock")
MODES = ("stock", "leantrain")
MIN_TIMED = 3  # timed steps each run needs before its step time says anything: fewer make no speed claim
# The steady-state cut may leave out up to half of a run and must keep MIN_TIMED steps: the fewest steps a run needs.
MIN_STEPS = 2 * MIN_TIMED
# A run seen settling for T steps is suggested a rerun of SETTLE_FACTOR x T steps: its start then falls inside the
# first third, well within the half the cut may leave out, and the steps kept outnumber it twice over.
SETTLE_FACTOR = 3
STEADY_RULE = (
    "each run timed from its steady state (MSER: leave out the first d steps, d in 1..n/2 minimizing the kept "
    "steps' sum of squared deviations over (n - d)^2)"
)
AGREE = 0.10  # the same-mode runs' medians must agree within 10% (or their own p20-p80 spread, if wider)
LOADED = 1.25  # load average over usable cores above which the host's other work can change step times
# Unit roundoff of each compute dtype: one rounding moves a value by at most u of itself.
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
LAYERS_UNKNOWN = 32  # rounding depth assumed when the model does not say how many decoder layers it has
CHECKED_METRICS = ("grad_norm", "entropy")  # held to the loss's rule too, where every run logs them
LEANER = 0.01  # a peak-memory difference is a claim only beyond 1% and when every run of one mode is below the other


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# --- where each run's timing starts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Steady:
    """Where one run's timing starts (``cut``: the first steps left out) and whether its timed steps had settled:
    ``unsettled`` says why not (None: settled), ``settling`` the steps it was seen still settling (0 when settled)."""

    cut: int
    unsettled: str | None = None
    settling: int = 0


def mser_cut(step_ms: Sequence[float]) -> int:
    """MSER (the marginal standard error rule of simulation output analysis): the d in [1, n//2] that minimizes
    sum((x_i - mean)^2) / (n - d)^2 over the kept steps x[d:]. A slow start inflates the kept steps' deviations
    more than leaving it out shortens them; noise alone rarely does. The first step (set-up) is always left out."""
    n = len(step_ms)
    best, cut = math.inf, min(1, n)
    for d in range(1, n // 2 + 1):
        kept = step_ms[d:]
        mean = sum(kept) / len(kept)
        score = sum((x - mean) ** 2 for x in kept) / len(kept) ** 2
        if score < best:  # the first of equal scores: the shortest cut
            best, cut = score, d
    return cut


def _moved(earlier: Sequence[float], later: Sequence[float]) -> bool:
    """The medians of two stretches of one run differ beyond the same-mode noise rule (AGREE, or either stretch's
    own p20-p80 spread, if wider)."""
    a, b = median(earlier), median(later)
    if min(a, b) <= 0:
        return False
    return abs(a / b - 1) > max(AGREE, _run_spread(earlier), _run_spread(later))


def _span(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _moving_text(earlier: Sequence[float], later: Sequence[float], where: tuple[int, int, int, int]) -> str:
    a, b = median(earlier), median(later)
    return (
        f"its step time still {'falling' if a > b else 'rising'}: median {a:.1f} ms over {_span(*where[:2])}, "
        f"{b:.1f} ms over {_span(*where[2:])}"
    )


def steady_state(step_ms: Sequence[float], warmup: int | None = None) -> Steady:
    """Where one run's timing starts: ``warmup`` steps when given, else the MSER cut. A run has not settled when
    its kept steps still trend (the first half's median against the second half's, beyond the noise rule), or when
    the MSER cut reached its limit (half the run) with the steps just before it still apart from the kept ones:
    the sign that the run is too short to show its steady state."""
    n = len(step_ms)
    cut = mser_cut(step_ms) if warmup is None else min(warmup, n)
    kept = step_ms[cut:]
    half = len(kept) // 2
    if half and _moved(kept[:half], kept[-half:]):
        where = (cut + 1, cut + half, n - half + 1, n)
        return Steady(cut, _moving_text(kept[:half], kept[-half:], where), n - half)
    before = step_ms[cut // 2 : cut]  # the later half of what the cut left out
    if warmup is None and cut == n // 2 and len(kept) >= MIN_TIMED and _moved(before, kept):
        where = (cut // 2 + 1, cut, cut + 1, n)
        text = _moving_text(before, kept, where) + ", and the cut reached its limit, half the run"
        return Steady(cut, text, cut)
    return Steady(cut)


def steady_states(runs: Sequence[Measurement], warmup: int | None) -> list[Steady]:
    return [steady_state(run.step_ms, warmup) for run in runs]


def unsettled(runs: Sequence[Measurement], steady: Sequence[Steady]) -> str | None:
    """Why no run that had not settled can back a speed claim, with the steps a rerun needs; None when all did."""
    late = [(run, s) for run, s in zip(runs, steady) if s.unsettled]
    if not late:
        return None
    run, first = late[0]
    n = len(run.step_ms)
    names = [r.label or "a run" for r, _ in late[1:]]
    others = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    steps = max(SETTLE_FACTOR * max(s.settling for _, s in late), n + 1)
    factor, loaded = host_contention([r for r, _ in late])
    # other work on the host moves step times too: then more steps alone may not settle them
    busy = f"; the host was loaded during {loaded.label or 'it'}{_load_text(loaded)}" if factor > LOADED else ""
    where = " on an idle machine" if busy else ""
    return (
        f"{run.label or 'a run'} had not settled within {n} steps ({first.unsettled})"
        + (f", nor had {others}" if others else "")
        + f"{busy}; rerun{where} with more steps (--steps {steps})"
    )


# --- the step-time statistics ------------------------------------------------------------------------------------


def timing(runs: Sequence[Sequence[float]], cuts: Sequence[int]) -> dict[str, Any]:
    """One mode's step times after each run's cut: pooled median and p20/p80, and each run's median."""
    timed = [run[cut:] for run, cut in zip(runs, cuts)]
    pooled = [t for run in timed for t in run]
    return {
        "median_ms": median(pooled),
        "p20_ms": quantile(pooled, 0.2),
        "p80_ms": quantile(pooled, 0.8),
        "run_medians_ms": [median(run) for run in timed],
        "timed_steps": len(pooled),
    }


def speed_verdict(stock: dict[str, Any], lean: dict[str, Any]) -> dict[str, Any]:
    """A speed claim needs both: the two modes' p20-p80 intervals (pooled over both runs of each) do not overlap,
    and every run of the faster mode has a lower median than every run of the other. Anything else is within
    noise. ``ratio`` is the ratio of the run medians (the median of stock's run medians over leantrain's), so one
    disturbed run cannot swing it; ``disturbance`` (below) can still turn a claim into "no claim"."""
    ratio = _ratio(median(stock["run_medians_ms"]), median(lean["run_medians_ms"]))
    # the ratio's spread: the slowest stock step of the p20-p80 band over the fastest leantrain one, and back
    spread = [stock["p20_ms"] / lean["p80_ms"], stock["p80_ms"] / lean["p20_ms"]] if lean["p20_ms"] > 0 else None
    if lean["p80_ms"] < stock["p20_ms"] and max(lean["run_medians_ms"]) < min(stock["run_medians_ms"]):
        verdict = "faster"
    elif stock["p80_ms"] < lean["p20_ms"] and max(stock["run_medians_ms"]) < min(lean["run_medians_ms"]):
        verdict = "slower"
    else:
        verdict = "within noise"
    return {"verdict": verdict, "ratio": ratio, "ratio_p20_p80": spread, "cause": None}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def _run_spread(steps: Sequence[float]) -> float:
    """One run's own relative spread: its p20-p80 width over its median."""
    middle = median(steps)
    return (quantile(steps, 0.8) - quantile(steps, 0.2)) / middle if middle > 0 else 0.0


def disagreement(
    by_mode: dict[str, Sequence[Measurement]], timed: dict[str, Sequence[Sequence[float]]], shift: float = 1.0
) -> str | None:
    """Why the same-mode runs cannot be trusted: their medians (over ``timed``, each run's steps after its cut)
    differ by more than AGREE, more than their own p20-p80 spread (a neighbour on the machine slowed one run, not
    the code) and by at least half the difference ``shift`` between the modes (a disagreement far smaller than the
    effect cannot make it); None otherwise."""
    for mode, runs in by_mode.items():
        medians = [median(t) for t in timed[mode]]
        if len(medians) < 2 or min(medians) <= 0:
            continue
        allowed = max(AGREE, *(_run_spread(t) for t in timed[mode]), (shift - 1) / 2)
        if max(medians) / min(medians) - 1 > allowed:
            slow = runs[medians.index(max(medians))]
            shown = " vs ".join(f"{m:.1f}" for m in medians)
            return (
                f"the two {mode} runs disagree ({shown} ms a step, beyond their own spread): something else on the "
                f"machine slowed {slow.label or mode}{_load_text(slow)}; rerun on an idle machine"
            )
    return None


def host_contention(runs: Sequence[Measurement]) -> tuple[float, Measurement | None]:
    """The largest load average over usable cores seen during any run (1.0 = every core busy), and that run."""
    worst, which = 1.0, None
    for run in runs:
        loads = [x for x in run.host_load if x is not None]
        if loads and max(loads) / max(run.cores, 1) > worst:
            worst, which = max(loads) / max(run.cores, 1), run
    return worst, which


def _load_text(run: Measurement) -> str:
    loads = [x for x in run.host_load if x is not None]
    return f" (host load average up to {max(loads):.1f} on {run.cores} cores)" if loads else ""


def disturbance(runs: Sequence[Measurement], steady: Sequence[Steady], speed: dict) -> str | None:
    """The cause that makes a speed claim unsafe on this machine, or None: too few timed steps, a run that had not
    settled, same-mode runs that disagree, or a host so loaded that the load alone could explain the ratio."""
    timed = min(len(r.step_ms) - s.cut for r, s in zip(runs, steady))
    if timed < MIN_TIMED:
        return f"{timed} timed step{'s' if timed != 1 else ''} a run, and a speed claim needs at least {MIN_TIMED}"
    late = unsettled(runs, steady)
    if late:
        return late
    ratio = speed["ratio"]
    shift = max(ratio, 1 / ratio) if math.isfinite(ratio) and ratio > 0 else float("inf")
    by_mode = _by_mode(runs)
    steps = {m: [run.step_ms[s.cut :] for run, s, o in zip(runs, steady, ORDER) if o == m] for m in MODES}
    cause = disagreement(by_mode, steps, shift)
    if cause:
        return cause
    factor, which = host_contention(runs)
    if speed["verdict"] in ("faster", "slower") and which is not None and factor > LOADED and shift <= factor:
        return (
            f"the host was loaded during {which.label or 'a run'}{_load_text(which)}: other work alone can change a "
            f"step's time by up to {factor:.1f}x, more than the {shift:.2f}x measured; rerun on an idle machine"
        )
    return None


def _by_mode(runs: Sequence[Measurement]) -> dict[str, list[Measurement]]:
    return {m: [r for r, o in zip(runs, ORDER) if o == m] for m in MODES}


def first_step(by_mode: dict[str, Sequence[Measurement]], saved_ms: float) -> dict[str, Any]:
    """The first step of every run, where compiling and other one-off set-up land (every detected cut leaves it out
    of the step-time median), told per leantrain launch: the first compiles (or loads what an earlier launch left in
    torch's compile caches), the second starts with the caches the first filled, as a user's next launch of the same
    run does. ``extra_ms``: how much longer the first leantrain launch's first step took than stock's (median),
    counted only when it is slower than every stock run's and by more than AGREE (else 0.0, within noise);
    ``second_launch_extra_ms`` the same for the second launch (None with one leantrain run); ``payback_steps``: the
    steps the per-step saving ``saved_ms`` needs to earn ``extra_ms`` back (None without one)."""
    firsts = {m: [r.step_ms[0] for r in by_mode[m] if r.step_ms] for m in MODES}
    stock, lean = firsts["stock"], firsts["leantrain"]
    extra = _extra_first_step(lean[0], stock) if lean else 0.0
    second = _extra_first_step(lean[1], stock) if len(lean) > 1 else None
    payback = math.ceil(extra / saved_ms) if extra > 0 and saved_ms > 0 else None
    return {
        "stock_ms": stock,
        "leantrain_ms": lean,
        "extra_ms": extra,
        "second_launch_extra_ms": second,
        "payback_steps": payback,
    }


def _extra_first_step(lean_ms: float, stock_ms: Sequence[float]) -> float:
    """How much longer one leantrain first step took than stock's median: 0.0 unless slower than every stock run's
    first step and by more than AGREE (noise)."""
    if not stock_ms or lean_ms <= max(stock_ms) or lean_ms <= (1 + AGREE) * median(stock_ms):
        return 0.0
    return lean_ms - median(stock_ms)


def _duration(ms: float) -> str:
    """Seconds from 1 s up, else milliseconds at the table's precision (0.1 ms)."""
    return f"{ms / 1e3:.1f} s" if round(ms, 1) >= 1e3 else f"{ms:.1f} ms"


def _first_step_text(first: dict[str, Any]) -> str:
    second = first.get("second_launch_extra_ms")
    once = round(first["extra_ms"], 1) > 0  # nothing to say below the table's precision
    text = ""
    if once:
        text = f"; the first step took {_duration(first['extra_ms'])} longer (once: compiling, set-up)"
        if first["payback_steps"] is None:
            text += ", and no measured step-time saving pays it back"
        else:
            text += f", paid back after {first['payback_steps']:,} steps"
    if second is None or not (once or round(second, 1) > 0):
        return text
    if round(second, 1) <= 0:
        return text + "; on the second launch (caches warm from the first) no longer than stock's"
    return text + f"; {_duration(second)} longer on the second launch (caches warm from the first)"


def memory_verdict(stock_peaks: Sequence[int | None], lean_peaks: Sequence[int | None]) -> dict[str, Any]:
    """ "leaner" / "heavier" when every run of one mode peaks more than 1% below every run of the other."""
    if any(p is None for p in (*stock_peaks, *lean_peaks)) or not stock_peaks or not lean_peaks:
        return {"verdict": "not measured", "ratio": None}
    ratio = max(lean_peaks) / min(stock_peaks) if min(stock_peaks) else None  # type: ignore[type-var, operator]
    if max(lean_peaks) < (1 - LEANER) * min(stock_peaks):  # type: ignore[type-var, operator]
        verdict = "leaner"
    elif min(lean_peaks) > (1 + LEANER) * max(stock_peaks):  # type: ignore[type-var, operator]
        verdict = "heavier"
    else:
        verdict = "same"
    return {"verdict": verdict, "ratio": ratio}


def loss_bounds(stock: Sequence[float | None], dtype: str, layers: int | None) -> list[float | None]:
    """Per step: 8·u·√(2L+2)·(|loss_k| + Σ_{j<=k} |loss_j - loss_{j-1}|), from stock's losses.

    The first term is the parity suite's bound on one forward whose roundings differ (the CUDA CGGR test's
    8·u·√(2L+2): u the dtype's unit roundoff, 2L+2 the roundings a loss passes through in L layers, each summed in
    another order, as independent errors). The second carries it along the run: Adam's update is scale-free, so a
    relative gradient error maps to a relative update error of the same order, and the loss's movement since step 1
    (its total variation) can differ by that relative amount."""
    u = UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["bf16"])
    rel = 8 * u * math.sqrt(2 * (layers or LAYERS_UNKNOWN) + 2)
    bounds: list[float | None] = []
    moved, previous = 0.0, None
    for loss in stock:
        if loss is None or not math.isfinite(loss):
            bounds.append(None)
            continue
        if previous is not None:
            moved += abs(loss - previous)
        previous = loss
        bounds.append(rel * (abs(loss) + moved))
    return bounds


def _pairs_diff(a_runs: Sequence[Sequence[float | None]], b_runs: Sequence[Sequence[float | None]], k: int) -> float:
    values = [a[k] for a in a_runs if k < len(a)], [b[k] for b in b_runs if k < len(b)]
    diffs = [abs(x - y) for x in values[0] for y in values[1] if x is not None and y is not None]
    return max(diffs) if diffs else float("nan")


def loss_check(
    stock: Sequence[Sequence[float | None]],
    lean: Sequence[Sequence[float | None]],
    dtype: str,
    layers: int | None,
) -> dict[str, Any]:
    """Per step: the largest |stock - leantrain| over the run pairs against the bound; the bound also holds each
    mode's own run-to-run spread twice (a nondeterministic stack: stock differs from stock by that much)."""
    steps = min(len(run) for run in (*stock, *lean))
    derived = loss_bounds(stock[0][:steps], dtype, layers)
    diffs, bounds, spread = [], [], 0.0
    split = None
    for k in range(steps):
        own = [_pairs_diff(stock[:1], stock[1:], k), _pairs_diff(lean[:1], lean[1:], k)]
        spread = max([spread, *(d for d in own if math.isfinite(d))])
        diff = _pairs_diff(stock, lean, k)
        bound = None if derived[k] is None else derived[k] + 2 * spread  # type: ignore[operator]
        diffs.append(diff if math.isfinite(diff) else None)
        bounds.append(bound)
        if split is None and bound is not None and math.isfinite(diff) and diff > bound:
            split = k + 1
    compared = sum(d is not None and b is not None for d, b in zip(diffs, bounds))
    return {
        "diff": diffs,
        "bound": bounds,
        "split_step": split,  # the first step (1-based) past the bound
        "compared_steps": compared,
        "same": split is None and compared > 0,
        "rule": f"8·u·√(2L+2)·(|loss| + Σ|Δloss|) + 2·(run-to-run spread), u = {_u_text(dtype)}, "
        f"L = {layers if layers else f'{LAYERS_UNKNOWN} (assumed)'}",
    }


def _u_text(dtype: str) -> str:
    exponent = {"fp32": 24, "bf16": 8, "fp16": 11}.get(dtype, 8)
    return f"2^-{exponent} ({dtype})"


def agreement(stock: Sequence[Measurement], lean: Sequence[Measurement]) -> dict[str, dict[str, Any]]:
    """The loss, and each of CHECKED_METRICS that every run logged, per step against its bound (loss_check)."""
    dtype, layers = lean[0].dtype, lean[0].layers
    checks = {"loss": loss_check([r.losses for r in stock], [r.losses for r in lean], dtype, layers)}
    for name in CHECKED_METRICS:
        if all(r.metrics.get(name) for r in (*stock, *lean)):
            values = [[r.metrics[name] for r in runs] for runs in (stock, lean)]
            checks[name] = loss_check(values[0], values[1], dtype, layers)
    return checks


def capped(runs: Sequence[Measurement]) -> str | None:
    """Where the script's own max_steps stopped a run before the steps asked for."""
    for run in runs:
        if 0 < run.max_steps < run.requested_steps:
            return f"the script capped its runs at max_steps={run.max_steps} ({run.requested_steps} steps asked for)"
    return None


def _losses_text(check: dict[str, Any]) -> str:
    pairs = [(d, b) for d, b in zip(check["diff"], check["bound"]) if d is not None and b is not None]
    if not pairs:
        return "same losses"
    # the bound of the step where the largest difference is (the smallest bound of the run, often step 1's, would
    # read as if that difference broke it)
    diff, bound = max(pairs, key=lambda pair: pair[0])
    return f"same losses (max diff {diff:.1e}, bound {bound:.1e} at that step)"


def rule_text(warmup: int | None) -> str:
    """Where the timing starts, as the output states it: the detection, or the override for every run."""
    if warmup is None:
        return STEADY_RULE
    return (
        f"the first {warmup} steps of every run not timed (--warmup {warmup}, in place of the steady-state detection)"
    )


def verdict(runs: Sequence[Measurement], warmup: int | None = None) -> dict[str, Any]:
    """Everything the comparison concludes, from the four runs (ORDER). Each run is timed from its own steady state
    (``steady_state``), or from step ``warmup`` + 1 of every run when it is given."""
    by_mode = _by_mode(runs)
    stock, lean = by_mode["stock"], by_mode["leantrain"]
    steady = steady_states(runs, warmup)
    cuts = {m: [s.cut for s, o in zip(steady, ORDER) if o == m] for m in MODES}
    times = {m: timing([r.step_ms for r in by_mode[m]], cuts[m]) for m in MODES}
    speed = speed_verdict(times["stock"], times["leantrain"])
    cause = disturbance(runs, steady, speed)
    cap = capped(runs)
    if cause:
        # too few steps or a run that had not settled: the script's own max_steps may be what stopped it short
        short = "timed step" in cause or "had not settled" in cause
        speed.update(verdict="no claim", cause=cause + (f"; {cap}" if cap and short else ""))
    memory = memory_verdict([r.peak_bytes for r in stock], [r.peak_bytes for r in lean])
    saved = times["stock"]["median_ms"] - times["leantrain"]["median_ms"] if speed["verdict"] == "faster" else 0.0
    first = first_step(by_mode, saved)
    checks = agreement(stock, lean)
    parts = [(c["split_step"], name != "loss", name) for name, c in checks.items() if c["split_step"]]
    split = min(parts, default=None)  # the first step past a bound; the loss first among metrics of that step
    applied = sorted(set(lean[0].applied) | set(lean[1].applied))
    changes_math = sorted(set(lean[0].changes_math))
    stock_applied = sorted({name for r in stock for name in r.applied})
    claims = [_speed_text(speed)] if speed["verdict"] in ("faster", "slower") else []
    if memory["verdict"] == "leaner":
        claims.append(f"{(1 - memory['ratio']) * 100:.0f}% less peak memory")
    elif memory["verdict"] == "heavier":
        claims.append(f"{(memory['ratio'] - 1) * 100:.0f}% more peak memory")
    if claims and speed["verdict"] == "within noise":
        claims.insert(0, "step time within noise")
    quiet = f"no claim: {speed['cause']}" if speed["cause"] else "within noise: no claim"
    tail = f"; no speed claim: {speed['cause']}" if speed["cause"] and claims else ""
    if stock_applied:
        text = (
            f"no claim: the stock runs applied {', '.join(stock_applied)} despite the kill switch (the script "
            "asks for it in code, which overrides LEANTRAIN_DISABLE=1)"
        )
    elif changes_math:
        what = ", ".join(changes_math)
        head = ", ".join(claims) + tail if claims else quiet
        text = f"{head} (losses not compared: {what} changes the training math by design)"
    elif split:  # even with nothing applied: then the runs are not the same training
        what = "losses differ" if split[2] == "loss" else f"{split[2]} differs"
        text = f"{what} from step {split[0]}: no claim"
    elif not applied:
        text = "nothing applied: no claim"
    elif not checks["loss"]["same"]:
        text = "losses not logged: no claim"
    elif claims:
        text = f"{', '.join(claims)}, {_losses_text(checks['loss'])}{tail}"
    else:
        text = quiet
    if applied and not stock_applied and not split:  # the one-off cost belongs to every verdict on what applied
        text += _first_step_text(first)
    measured = bool(applied and not stock_applied and claims and (split is None or changes_math))
    hurt = speed["verdict"] == "slower" or memory["verdict"] == "heavier"
    return {
        "text": text,
        "applied": applied,
        "changes_math": changes_math,
        "speed": {**speed, **{m: times[m] for m in MODES}},
        "memory": memory,
        "first_step": first,
        "steady": {
            "rule": rule_text(warmup),
            "warmup": "auto" if warmup is None else warmup,
            "runs": [
                {"label": r.label, "cut": s.cut, "settled": s.unsettled is None, "unsettled": s.unsettled}
                for r, s in zip(runs, steady)
            ],
        },
        "losses": checks["loss"],
        "metrics": {name: c for name, c in checks.items() if name != "loss"},
        "capped": cap,
        "helped": measured and not hurt,
        # what --keep may write: "helped" / "hurt" from a claim; None (keep nothing) from noise or no claim
        "keep": ("hurt" if hurt else "helped") if measured else None,
    }


def _speed_text(speed: dict[str, Any]) -> str:
    if speed["verdict"] == "faster":
        return f"faster by {speed['ratio']:.2f}x"
    if speed["verdict"] == "slower":
        return f"slower by {1 / speed['ratio']:.2f}x"
    return "within noise"


def cuts_by_mode(result: dict[str, Any]) -> dict[str, list[int]]:
    """Each run's cut as the verdict recorded it, per mode in the order of its runs."""
    cuts = [run["cut"] for run in result["steady"]["runs"]]
    return {m: [c for c, o in zip(cuts, ORDER) if o == m] for m in MODES}


def tokens_per_s(runs: Sequence[Measurement], cuts: Sequence[int]) -> float | None:
    """Tokens over wall time of the timed steps (each run's own after its cut)."""
    tokens = [t for r, c in zip(runs, cuts) for t in r.tokens[c:]]
    ms = [t for r, c in zip(runs, cuts) for t in r.step_ms[c:]]
    if not tokens or any(t is None for t in tokens) or not sum(ms):
        return None
    return sum(tokens) / (sum(ms) / 1e3)  # type: ignore[arg-type]
