"""Fused GRPO log-probs: leantrain's op vs materialized logits, TRL 1.16's ChunkedLogProbFunction,
cut-cross-entropy and Liger (when importable), frozen-head fwd+bwd, no-grad forward (with leantrain_default: what
the patched trainer runs there, TRL's own head where the measured rule says it is faster, issue #28) and a
trainable-head row (with leantrain_triton_keep: the forward's logits kept for the backward, issue #13); plus CUDA
parity (max |Δlogp| vs fp64 on a slice).

    python benchmarks/bench_grpo_logps.py            # CUDA, full shapes (H100: < 4 min)
    python benchmarks/bench_grpo_logps.py --smoke    # tiny shapes, CPU or GPU, < 60 s

Writes grpo_logps.json / .md / .png into $BENCH_RESULTS or benchmarks/results/.

``--nograd``: the measurements behind the no-grad rule (``leantrain.grpo_logps.nograd``: no-grad calls on TRL's fused
path go to TRL's own head). GRPO scores the old policy and the reference model under ``torch.no_grad()``; TRL 1.16
calls the model once per ``per_device_train_batch_size`` rows (default 8) and its fused head scores only the labelled
positions: N = those rows' completion tokens (<= 8 x 512 = 4096 by default, 16384 at 8 x 2048). The policy's head
computes log-probs + entropy there (its outputs are fixed when TRL patches it), the reference model's log-probs only:
both are measured, TRL's head against leantrain's op (default tile budget), over the heads of Qwen2.5-0.5B to 14B and
Llama-3-8B x N 1024-16384. ``--emit-rule [JSON]`` checks those rows against the rule and prints its constants.

    python benchmarks/bench_grpo_logps.py --nograd [--smoke]   # CUDA, full grid (H100: ~2 min); writes
                                                               # grpo_logps_nograd.json / .md
    python benchmarks/bench_grpo_logps.py --emit-rule [JSON]   # CPU; default: grpo_logps_nograd.json of the results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from _harness import RESULTS, Row, bar_plot, markdown_table, peak_memory, read_rows, time_fn, write_results  # noqa: E402

from leantrain.config import LeantrainConfig  # noqa: E402
from leantrain.grpo_logps import nograd  # noqa: E402
from leantrain.lm_head import ops  # noqa: E402


BENCH = "grpo_logps"
TEMPERATURE = 0.7
FULL_SHAPES = [(8192, 2048, 151936), (16384, 4096, 128256)]
SMOKE_SHAPES = [(256, 64, 1001)]
KEEP_ALL_MIB = 1 << 20  # keep_logits_mib that keeps any shape's logits (issue #13: 3 GEMMs instead of 4)
TRAINABLE_PROVIDERS = ("trl_chunked", "leantrain_triton", "leantrain_triton_keep", "leantrain_torch", "materialized")
TRAINABLE_ONLY = ("leantrain_triton_keep",)  # a frozen head never keeps logits: same as leantrain_triton


def make_inputs(n: int, h: int, v: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g)
    # logit std ≈ 4, like a trained LM head
    weight = torch.randn(v, h, device=device, dtype=dtype, generator=g) * (4 / h**0.5)
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    return hidden, weight, targets


# ----------------------------------------------------------------------------------------------- providers
# Each returns (logp [N] fp32-ish, entropy or None); gradients flow into hidden (and weight if it requires grad).
def materialized(h, w, t):
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logits = h @ w.T
    logp = selective_log_softmax(logits, t, temperature=TEMPERATURE)
    with torch.no_grad():  # TRL <= 1.14 logs the entropy without gradient
        entropy = entropy_from_logits(logits.detach() / TEMPERATURE)
    return logp, entropy


def trl_chunked(h, w, t, outputs=("log_probs", "entropy")):
    """TRL >= 1.15's fused head: the function and chunk size its forward looks up in trl.trainer.utils."""
    from trl.trainer import utils as trl_utils

    chunk = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    out = trl_utils._ChunkedLogProbFunction.apply(h, w, None, t, TEMPERATURE, chunk, None, 1.0, outputs)
    return out[0], out[1]


def cce(h, w, t):
    from cut_cross_entropy import linear_cross_entropy

    # CCE has no temperature argument: fold 1/T into the hidden states; no entropy in any CCE version
    nll = linear_cross_entropy(e=h / TEMPERATURE, c=w, targets=t, filter_eps=None, reduction="none")
    return -nll, None


def liger(h, w, t):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(h / TEMPERATURE, w, t, reduction="none")
    nll = out[0] if isinstance(out, tuple) else out
    return -nll, None


def leantrain_backend(backend: str, keep_logits_mib: int = 0) -> Callable:
    def run(h, w, t):
        return ops.logp_entropy(h, w, t, temperature=TEMPERATURE, backend=backend, keep_logits_mib=keep_logits_mib)

    return run


def leantrain_default(h, w, t):
    """What the patched trainer runs by default: leantrain's op, or TRL's own head for a no-grad call where the
    no-grad rule (``nograd.trl_head_serves``, the trainer's own decision) says TRL's is faster."""
    from leantrain.grpo_logps import nograd

    backend = ops.default_backend(h.device)
    if not torch.is_grad_enabled() and nograd.trl_head_serves(w.shape[0], backend):
        return trl_chunked(h, w, t)
    return leantrain_backend(backend)(h, w, t)


def providers(device: str) -> dict[str, Callable]:
    found: dict[str, Callable] = {"materialized": materialized, "trl_chunked": trl_chunked}
    if device == "cuda":
        for name, fn, module in (("cce", cce, "cut_cross_entropy"), ("liger", liger, "liger_kernel")):
            try:
                __import__(module)
                found[name] = fn
            except Exception as error:  # not installed, or no GPU build
                print(f"skipping {name}: {type(error).__name__}: {error}")
    if device == "cuda" and ops.triton_available():
        found["leantrain_triton"] = leantrain_backend("triton")
        found["leantrain_triton_keep"] = leantrain_backend("triton", KEEP_ALL_MIB)
    found["leantrain_torch"] = leantrain_backend("torch")
    found["leantrain_default"] = leantrain_default
    return found


def runs_in_case(name: str, trainable: bool, mode: str = "full") -> bool:
    """Trainable-head rows: the providers with a weight gradient; leantrain_triton_keep only there. leantrain_default
    only in the no-grad forward rows: with a gradient it is leantrain's op, already a row."""
    if name == "leantrain_default":
        return mode == "forward" and not trainable
    return name in TRAINABLE_PROVIDERS if trainable else name not in TRAINABLE_ONLY


# ------------------------------------------------------------------------------------------------- timing
def bench_case(name, fn, hidden, weight, targets, mode, trainable, reps, warmup):
    grad_out = torch.randn(targets.shape[0], device=hidden.device)

    def step(_i=0):
        if mode == "forward":
            with torch.no_grad():
                fn(hidden, weight, targets)
            return
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_(trainable)
        logp, _ = fn(h, w, targets)
        (logp.float() * grad_out).sum().backward()

    t = time_fn(step, warmup=warmup, reps=reps)
    mem = peak_memory(step)
    return t, mem


def gemm_count(mode: str, trainable: bool) -> int:
    """The N x H x V GEMMs no log-prob op can avoid: the logits (forward); with grad, dH = dZ @ W (the forward's
    logits reused); a trainable head adds dW = dZ^T @ H. Each is 2*N*H*V flops."""
    return 1 if mode == "forward" else 3 if trainable else 2


def gemm_floor(hidden: torch.Tensor, weight: torch.Tensor, mode: str, trainable: bool, reps: int, warmup: int):
    """The floor: those GEMMs alone, back to back in the inputs' dtype (cuBLAS; the logits materialized, memory
    ignored). A provider's ratio to it is what its softmax passes, recompute and tiling cost on top."""
    count = gemm_count(mode, trainable)

    def step(_i=0):
        with torch.no_grad():
            z = hidden @ weight.T
            if count >= 2:
                z @ weight
            if count == 3:
                z.T @ hidden

    return time_fn(step, warmup=warmup, reps=reps)


def tflops(n: int, h: int, v: int, mode: str, trainable: bool, ms: float) -> float:
    return gemm_count(mode, trainable) * 2 * n * h * v / (ms * 1e-3) / 1e12


def parity(device: str, shape, rows: int = 1024) -> list[tuple[str, float, float]]:
    """max |Δlogp| and relative dh error vs fp64 on the first `rows` tokens (bf16 inputs)."""
    n, h, v = shape
    hidden, weight, targets = make_inputs(min(n, rows), h, v, device, torch.bfloat16, seed=1)
    h64 = hidden.double().requires_grad_()
    z = (h64 @ weight.double().T) / TEMPERATURE
    ref = torch.log_softmax(z, -1).gather(1, targets[:, None]).squeeze(1)
    ref.sum().backward()
    out = []
    for name, fn in providers(device).items():
        if not runs_in_case(name, trainable=False):
            continue
        hh = hidden.detach().requires_grad_()
        try:
            logp, _ = fn(hh, weight, targets)
            logp.float().sum().backward()
        except Exception as error:
            print(f"parity {name} failed: {error}")
            continue
        err = (logp.double() - ref).abs().max().item()
        gerr = ((hh.grad.double() - h64.grad).norm() / h64.grad.norm()).item()
        out.append((name, err, gerr))
    return out


# ------------------------------------------------------------------------------------------ --nograd, --emit-rule
NOGRAD = "grpo_logps_nograd"
STOCK, FUSED = "trl_stock", "leantrain"
# (model, H, V): Qwen2.5 0.5B-14B (the 7B and 14B vocabularies are 152064) and Llama-3 8B
NOGRAD_MODELS = [
    ("qwen2.5-0.5b", 896, 151936),
    ("qwen2.5-1.5b", 1536, 151936),
    ("qwen2.5-3b", 2048, 151936),
    ("qwen2.5-7b", 3584, 152064),
    ("qwen2.5-14b", 5120, 152064),
    ("llama-3-8b", 4096, 128256),
]
NOGRAD_N = (1024, 2048, 4096, 8192, 16384)
NOGRAD_SMOKE_MODELS = [("tiny-a", 32, 1001), ("tiny-b", 64, 2003)]
NOGRAD_SMOKE_N = (64, 128)


def nograd_heads(entropy: bool, backend: str) -> dict[str, Callable]:
    """TRL's fused head as it is called under no_grad (the outputs TRL asks for) and leantrain's op as the trainer's
    wrapped forward runs it (default tile budget)."""
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    tile_mib = LeantrainConfig().grpo_logps_tile_mib
    kw = dict(temperature=TEMPERATURE, need_entropy=entropy, tile_mib=tile_mib, backend=backend)
    return {
        STOCK: lambda h, w, t: trl_chunked(h, w, t, outputs=outputs),
        FUSED: lambda h, w, t: ops.logp_entropy(h, w, t, **kw),
    }


def nograd_grid(models, n_values, device: str, reps: int, warmup: int) -> tuple[list[Row], list[list]]:
    """Rows (speed, memory) and table lines of both heads under no_grad, bf16, over models x N x entropy."""
    backend = ops.default_backend(torch.device(device))
    rows: list[Row] = []
    table: list[list] = []
    for model, h, v in models:
        hidden_all, weight, targets_all = make_inputs(max(n_values), h, v, device, torch.bfloat16)
        for i, n in enumerate(n_values):
            hidden, targets = hidden_all[:n], targets_all[:n]
            for entropy in (True, False):
                config = dict(model=model, N=n, H=h, V=v, dtype="bfloat16", entropy=entropy)
                heads = list(nograd_heads(entropy, backend).items())
                if (i + entropy) % 2:  # alternate the order over N and entropy: neither always runs first
                    heads.reverse()
                got = {}
                for name, fn in heads:
                    t, mem = bench_case(name, fn, hidden, weight, targets, "forward", False, reps, warmup)
                    got[name] = (t.p50, mem)
                    rows.append(Row.timing(NOGRAD, name, "no_grad", "N", n, t, **config, backend=backend))
                    rows.append(Row(NOGRAD, name, "no_grad", "memory", "GiB", "N", n, mem, config=config))
                (ts, ms), (tf, mf) = got[STOCK], got[FUSED]
                rule = "stock" if nograd.trl_head_serves(v, backend) else "fused"
                table.append([model, n, h, v, entropy, ts, tf, ts / tf, ms, mf, "stock" if ts < tf else "fused", rule])
                print(
                    f"{model:13s} N={n:6d} entropy={entropy!s:5s} stock {ts:8.3f} ms  fused {tf:8.3f} ms", flush=True
                )
        del hidden_all, weight, targets_all
    return rows, table


def run_nograd(smoke: bool, device: str) -> Path:
    models, n_values = (NOGRAD_SMOKE_MODELS, NOGRAD_SMOKE_N) if smoke else (NOGRAD_MODELS, NOGRAD_N)
    reps, warmup = (3, 1) if smoke else (25, 5)
    rows, table = nograd_grid(models, n_values, device, reps, warmup)
    header = ["model", "N", "H", "V", "entropy", "TRL ms", "leantrain ms", "speed-up vs TRL", "TRL GiB",
              "leantrain GiB", "faster", "rule now"]  # fmt: skip
    md = markdown_table(header, table) + (
        "\n\nNo-grad calls (torch.no_grad), bf16, median CUDA-event ms. TRL: ChunkedLogProbFunction as TRL's fused "
        "head calls it on the scored rows; leantrain: its op (default tile budget). 'rule now': what "
        "leantrain.grpo_logps.nograd decides at the time of the run; check it with "
        "`python benchmarks/bench_grpo_logps.py --emit-rule`."
    )
    out = write_results(NOGRAD, rows, md)
    print(md)
    return out


def rule_cells(rows: list[Row]) -> dict[tuple, tuple[float, float]]:
    """(TRL ms, leantrain ms) per measured (N, H, V, dtype, entropy) cell of the no-grad speed rows."""
    cells: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row.benchmark != NOGRAD or row.metric != "speed":
            continue
        c = row.config
        key = (int(c["N"]), int(c["H"]), int(c["V"]), str(c["dtype"]), bool(c["entropy"]))
        cells.setdefault(key, {})[row.provider] = float(row.p50)
    return {key: (t[STOCK], t[FUSED]) for key, t in sorted(cells.items()) if STOCK in t and FUSED in t}


def emit_rule(path: Path) -> str:
    """Check no-grad rows against ``nograd.py``'s rule (TRL's head serves every no-grad call on TRL's fused path) and
    return the rule's constants from them, as Python to paste; exit naming the cells that break the rule."""
    rows = read_rows(path)
    cells = rule_cells(rows)
    if not cells:
        raise SystemExit(f"no no-grad rows in {path}: run `python benchmarks/bench_grpo_logps.py --nograd` first")
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
    source = f"{head.device}, {head.date[:10]}, {NOGRAD}.json at {head.commit}"
    return "\n".join([
        f"# {len(cells)} cells: TRL's head faster in {faster}, the others within {nograd.NOISE:.0%}",
        f"SOURCE = {json.dumps(source)}",
        f"MEASURED_V = ({vocabularies[0]}, {vocabularies[-1]})",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few reps (CPU ok)")
    parser.add_argument("--nograd", action="store_true", help="TRL's head vs leantrain's op under no_grad, by shape")
    parser.add_argument(
        "--emit-rule", nargs="?", const="", metavar="JSON", help="check the no-grad rule against the rows, print it"
    )
    args = parser.parse_args(argv)
    if args.emit_rule is not None:
        out_dir = Path(os.environ.get("BENCH_RESULTS", RESULTS))
        print(emit_rule(Path(args.emit_rule) if args.emit_rule else out_dir / f"{NOGRAD}.json"))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        sys.exit("full benchmark needs CUDA; use --smoke on CPU")
    torch.manual_seed(0)
    if device == "cpu":
        torch.set_num_threads(1)
    if args.nograd:
        print(f"results in {run_nograd(args.smoke, device)}")
        return
    shapes = SMOKE_SHAPES if args.smoke else FULL_SHAPES
    reps, warmup = (3, 1) if args.smoke else (10, 3)
    dtype = torch.bfloat16
    rows: list[Row] = []
    table: list[list] = []
    plot: dict[str, list[float]] = {}
    groups: list[str] = []
    cases = [(shape, mode, False) for shape in shapes for mode in ("full", "forward")] + [(shapes[0], "full", True)]
    for shape, mode, trainable in cases:
        n, h, v = shape
        hidden, weight, targets = make_inputs(n, h, v, device, dtype)
        label = f"N={n} H={h} V={v} {mode}{' trainable head' if trainable else ''}"
        groups.append(label)
        results = {}
        floor = gemm_floor(hidden, weight, mode, trainable, reps, warmup)
        config = dict(N=n, H=h, V=v, dtype=str(dtype), temperature=TEMPERATURE, trainable_head=trainable)
        rows.append(Row.timing(BENCH, "gemm_floor", mode, "shape", f"{n}x{h}x{v}", floor, **config))
        print(f"{label:48s} {'gemm_floor':18s} {floor.p50:9.2f} ms", flush=True)
        for name, fn in providers(device).items():
            if not runs_in_case(name, trainable, mode):
                continue
            if name == "leantrain_torch" and device == "cuda" and n > 8192:
                continue  # the reference path; one CUDA shape is enough to show it
            try:
                t, mem = bench_case(name, fn, hidden, weight, targets, mode, trainable, reps, warmup)
            except Exception as error:  # e.g. OOM of the materialized baseline
                print(f"{label} {name}: {type(error).__name__}: {error}")
                continue
            results[name] = (t, mem)
            rows.append(Row.timing(BENCH, name, mode, "shape", f"{n}x{h}x{v}", t, **config))
            rows.append(Row(BENCH, name, mode, "memory", "GiB", "shape", f"{n}x{h}x{v}", mem, config=config))
            achieved = tflops(n, h, v, mode, trainable, t.p50)
            extra = {**config, "gemms": gemm_count(mode, trainable), "floor_ms": floor.p50}
            shape = f"{n}x{h}x{v}"
            rows.append(Row(BENCH, name, mode, "throughput", "TFLOP/s", "shape", shape, achieved, config=extra))
            print(f"{label:48s} {name:18s} {t.p50:9.2f} ms  {mem:6.3f} GiB", flush=True)
        for name, (t, mem) in results.items():
            trl_ms = results.get("trl_chunked", (None,))[0]
            cce_ms = results.get("cce", (None,))[0]
            table.append(
                [
                    label,
                    name,
                    t.p50,
                    mem,
                    trl_ms.p50 / t.p50 if trl_ms else float("nan"),
                    cce_ms.p50 / t.p50 if cce_ms else float("nan"),
                    tflops(n, h, v, mode, trainable, t.p50),
                    t.p50 / floor.p50,
                ]
            )
        table.append([label, "gemm_floor", floor.p50, float("nan"), float("nan"), float("nan"),
                      tflops(n, h, v, mode, trainable, floor.p50), 1.0])  # fmt: skip
        for name in providers(device):
            plot.setdefault(name, []).append(results[name][0].p50 if name in results else 0.0)
    for name, err, gerr in parity(device, shapes[0]):
        cfg = dict(rows=1024, dtype="bfloat16", temperature=TEMPERATURE)
        rows.append(
            Row(BENCH, name, "parity", "quality", "max_abs_logp_err", "shape", str(shapes[0]), err, config=cfg)
        )
        rows.append(Row(BENCH, name, "parity", "quality", "rel_dh_err", "shape", str(shapes[0]), gerr, config=cfg))
        print(f"parity {name:18s} max|Δlogp| {err:.3e}  rel dh err {gerr:.3e}")
    header = ["case", "provider", "median ms", "peak GiB", "speed-up vs TRL", "speed-up vs CCE", "TFLOP/s", "x floor"]
    md = markdown_table(header, table)
    md += (
        "\n\nTFLOP/s: the GEMMs no log-prob op can avoid (logits; dH with grad; dW with a trainable head; 2NHV flops "
        "each) over the provider's time. x floor: its time over those GEMMs' alone (gemm_floor: cuBLAS, logits "
        "materialized)."
    )
    out = write_results(BENCH, rows, md)
    try:
        bar_plot(out / f"{BENCH}.png", "GRPO log-probs (median ms, lower is better)", groups, plot, "ms")
    except Exception as error:  # matplotlib missing is not a benchmark failure
        print(f"plot skipped: {error}")
    print(md)
    print(f"results in {out if out else RESULTS}")


if __name__ == "__main__":
    main()
