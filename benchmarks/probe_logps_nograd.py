"""No-grad log-probs (GRPO's old-policy and reference scoring, issue #28): TRL 1.16's own fused head vs leantrain's
op over the GRPO recipe shapes: the measurements behind the rule that sends no-grad calls to TRL's head
(``leantrain.grpo_logps.nograd``).

What one no-grad call scores: TRL 1.16's ``_get_per_token_logps_and_entropies`` calls the model once per
``batch_size`` rows (``per_device_train_batch_size``, default 8) and the fused head scores only the labelled
positions on CUDA: N = the completion tokens of those rows (<= 8 x ``max_completion_length`` = 4096 by default;
16384 at 8 x 2048). The policy's head computes log-probs + entropy even there (its outputs are fixed when TRL patches
it); the reference model's log-probs only: both are measured.

    python benchmarks/probe_logps_nograd.py               # CUDA, full grid (H100: ~2 min)
    python benchmarks/probe_logps_nograd.py --smoke       # tiny shapes, CPU ok, seconds
    python benchmarks/probe_logps_nograd.py --emit-rule   # check the rule against the JSON, print its constants

Writes grpo_logps_nograd.json / .md (and _profile.txt: both heads kernel by kernel at N=8192 H=2048 V=151936, the
cell of issue #28) into $BENCH_RESULTS or benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import bench_grpo_logps as bench  # noqa: E402
import torch
from _harness import RESULTS, Row, markdown_table, peak_memory, read_rows, time_fn, write_results  # noqa: E402

from leantrain.config import LeantrainConfig  # noqa: E402
from leantrain.grpo_logps import nograd  # noqa: E402
from leantrain.lm_head import ops  # noqa: E402


BENCH = "grpo_logps_nograd"
STOCK, FUSED, TALL = "trl_stock", "leantrain", "leantrain_tall_tiles"
# (model, H, V): Qwen2.5 0.5B-14B (the 7B and 14B vocabularies are 152064) and Llama-3 8B
MODELS = [
    ("qwen2.5-0.5b", 896, 151936),
    ("qwen2.5-1.5b", 1536, 151936),
    ("qwen2.5-3b", 2048, 151936),
    ("qwen2.5-7b", 3584, 152064),
    ("qwen2.5-14b", 5120, 152064),
    ("llama-3-8b", 4096, 128256),
]
N_VALUES = (1024, 2048, 4096, 8192, 16384)
SMOKE_MODELS = [("tiny-a", 32, 1001), ("tiny-b", 64, 2003)]
SMOKE_N = (64, 128)
TILE_MIB = LeantrainConfig().grpo_logps_tile_mib  # what the trainer passes the op by default


def stock_head(entropy: bool) -> Callable:
    """TRL's fused head's call under no_grad (bench_grpo_logps's trl_chunked provider, same outputs as TRL asks)."""
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    return lambda h, w, t: bench.trl_chunked(h, w, t, outputs=outputs)


def fused_head(entropy: bool, backend: str) -> Callable:
    """leantrain's op as the trainer's wrapped forward runs it (default tile budget)."""

    def run(h, w, t):
        kw = dict(temperature=bench.TEMPERATURE, need_entropy=entropy, tile_mib=TILE_MIB, backend=backend)
        return ops.logp_entropy(h, w, t, **kw)

    return run


def tall_tiles(entropy: bool, backend: str, rows: int) -> Callable:
    """A candidate, not a default: leantrain's op with logits tiles of up to ``rows`` rows (2 x MAX_TILE_ROWS: 8192 x
    32768 bf16 = 512 MiB, still within the default tile budget), measured where N allows them (issue #28, item 3)."""
    run = fused_head(entropy, backend)

    def go(h, w, t):
        old = ops.MAX_TILE_ROWS
        ops.MAX_TILE_ROWS = rows
        try:
            return run(h, w, t)
        finally:
            ops.MAX_TILE_ROWS = old

    return go


def measure(fn: Callable, hidden, weight, targets, reps: int, warmup: int):
    def step(_i=0):
        with torch.no_grad():
            fn(hidden, weight, targets)

    return time_fn(step, warmup=warmup, reps=reps), peak_memory(step)


def run_grid(models, n_values, device: str, dtype: torch.dtype, reps: int, warmup: int) -> tuple[list[Row], list]:
    backend = ops.default_backend(torch.device(device))
    tall_rows = 2 * ops.MAX_TILE_ROWS
    rows: list[Row] = []
    table: list[list] = []
    g = torch.Generator(device=device).manual_seed(0)
    for model, h, v in models:
        n_max = max(n_values)
        hidden_all = torch.randn(n_max, h, device=device, dtype=dtype, generator=g)
        weight = (torch.randn(v, h, device=device, dtype=dtype, generator=g) * (4 / h**0.5)).contiguous()
        targets_all = torch.randint(0, v, (n_max,), device=device, generator=g)
        for i, n in enumerate(n_values):
            hidden, targets = hidden_all[:n], targets_all[:n]
            for entropy in (True, False):
                config = dict(model=model, N=n, H=h, V=v, dtype=str(dtype).removeprefix("torch."), entropy=entropy)
                providers = [(STOCK, stock_head(entropy)), (FUSED, fused_head(entropy, backend))]
                if (i + entropy) % 2:  # alternate the order over N and entropy: neither always runs first
                    providers.reverse()
                if entropy and n >= tall_rows:  # a different tile plan from the default's only there
                    providers.append((TALL, tall_tiles(entropy, backend, tall_rows)))
                got = {}
                for name, fn in providers:
                    t, mem = measure(fn, hidden, weight, targets, reps, warmup)
                    got[name] = (t, mem)
                    rows.append(Row.timing(BENCH, name, "no_grad", "N", n, t, **config, backend=backend))
                    rows.append(Row(BENCH, name, "no_grad", "memory", "GiB", "N", n, mem, config=config))
                (ts, ms), (tf, mf) = got[STOCK], got[FUSED]
                rule = nograd.trl_head_serves(v, backend)
                tall = got[TALL][0].p50 if TALL in got else float("nan")
                faster, rule_now = ("stock" if ts.p50 < tf.p50 else "fused"), ("stock" if rule else "fused")
                table.append(
                    [model, n, h, v, entropy, ts.p50, tf.p50, ts.p50 / tf.p50, ms, mf, faster, rule_now, tall]
                )
                print(f"{model:13s} N={n:6d} entropy={entropy!s:5s} stock {ts.p50:8.3f} ms  fused {tf.p50:8.3f} ms",
                      flush=True)  # fmt: skip
        del hidden_all, weight, targets_all
    return rows, table


def profile_cell(model: str, n: int, h: int, v: int, device: str, dtype: torch.dtype) -> str:
    """Per-kernel times of both heads on one cell (log-probs + entropy, 5 calls each): where a gap comes from (the
    logits GEMMs or the fold), for work on leantrain's no-grad forward itself."""
    from torch.profiler import ProfilerActivity, profile

    backend = ops.default_backend(torch.device(device))
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g)
    weight = torch.randn(v, h, device=device, dtype=dtype, generator=g) * (4 / h**0.5)
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    parts = [f"# {model} N={n} H={h} V={v} {str(dtype).removeprefix('torch.')}, log-probs + entropy, 5 calls"]
    for name, fn in ((STOCK, stock_head(True)), (FUSED, fused_head(True, backend))):
        with torch.no_grad():
            for _ in range(3):
                fn(hidden, weight, targets)
            torch.cuda.synchronize() if cuda else None
            with profile(activities=activities) as prof:
                for _ in range(5):
                    fn(hidden, weight, targets)
                torch.cuda.synchronize() if cuda else None
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        parts.append(f"## {name}\n{prof.key_averages().table(sort_by=sort, row_limit=12)}")
    return "\n\n".join(parts)


def rule_cells(rows: list[Row]) -> dict[tuple, tuple[float, float]]:
    """(TRL ms, leantrain ms) per measured (N, H, V, dtype, entropy) cell of the probe's speed rows."""
    cells: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row.benchmark != BENCH or row.metric != "speed":
            continue
        c = row.config
        key = (int(c["N"]), int(c["H"]), int(c["V"]), str(c["dtype"]), bool(c["entropy"]))
        cells.setdefault(key, {})[row.provider] = float(row.p50)
    return {key: (t[STOCK], t[FUSED]) for key, t in sorted(cells.items()) if STOCK in t and FUSED in t}


def emit_rule(path: Path) -> str:
    """Check a probe JSON against ``nograd.py``'s rule (TRL's head serves every no-grad call on TRL's fused path)
    and return the rule's constants from it, as Python to paste; exit naming the cells that break the rule."""
    rows = read_rows(path)
    cells = rule_cells(rows)
    if not cells:
        raise SystemExit(f"no probe results in {path}: run the probe first")
    lost = [key for key, (stock, fused) in cells.items() if not nograd.trl_head_wins(stock, fused)]
    if lost:
        where = ", ".join(f"N={n} H={h} V={v} {dtype} entropy={entropy}" for n, h, v, dtype, entropy in lost)
        raise SystemExit(
            f"leantrain's op measured faster beyond the {nograd.NOISE:.0%} noise at {where}: no-grad calls no longer "
            "all belong to TRL's head; grpo_logps/nograd.py needs a rule by shape"
        )
    faster = sum(stock < fused for stock, fused in cells.values())
    vocabularies = sorted({key[2] for key in cells})
    head = rows[0]
    source = f"{head.device}, {head.date[:10]}, {BENCH}.json at {head.commit}"
    return "\n".join([
        f"# {len(cells)} cells: TRL's head faster in {faster}, the others within {nograd.NOISE:.0%}",
        f"SOURCE = {json.dumps(source)}",
        f"MEASURED_V = ({vocabularies[0]}, {vocabularies[-1]})",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few reps (CPU ok)")
    parser.add_argument(
        "--emit-rule", nargs="?", const="", metavar="JSON", help="check the rule against the results, print it, exit"
    )
    args = parser.parse_args(argv)
    out_dir = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    if args.emit_rule is not None:
        print(emit_rule(Path(args.emit_rule) if args.emit_rule else out_dir / f"{BENCH}.json"))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        sys.exit("the probe needs CUDA; use --smoke on CPU")
    if device == "cpu":
        torch.set_num_threads(1)
    models, n_values = (SMOKE_MODELS, SMOKE_N) if args.smoke else (MODELS, N_VALUES)
    reps, warmup = (3, 1) if args.smoke else (25, 5)
    rows, table = run_grid(models, n_values, device, torch.bfloat16, reps, warmup)
    header = ["model", "N", "H", "V", "entropy", "TRL ms", "leantrain ms", "speed-up vs TRL", "TRL GiB",
              "leantrain GiB", "faster", "rule now", "tall tiles ms"]  # fmt: skip
    md = markdown_table(header, table)
    md += (
        "\n\nNo-grad calls (torch.no_grad), bf16, median CUDA-event ms. TRL: ChunkedLogProbFunction as TRL 1.16's "
        "fused head calls it on the scored rows; leantrain: its op (Triton backend, default tile budget). 'rule now': "
        "what leantrain.grpo_logps.nograd decides at the time of the run; check it with "
        "`python benchmarks/probe_logps_nograd.py --emit-rule`. 'tall tiles': a candidate (not the default), "
        f"leantrain's op with logits tiles of twice {ops.MAX_TILE_ROWS} rows (same tile budget), where N allows them."
    )
    out = write_results(BENCH, rows, md, out_dir)
    # the cell (TRL 9.05 vs leantrain 9.78 ms on an H100): kernel by kernel
    model, h, v = next((m for m in models if m[1] == 2048), models[0])
    n = 8192 if 8192 in n_values else max(n_values)
    (out / f"{BENCH}_profile.txt").write_text(profile_cell(model, n, h, v, device, torch.bfloat16))
    print(md)
    print(f"results in {out}")


if __name__ == "__main__":
    main()
