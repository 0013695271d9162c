"""Where the LM-head op's time goes at the SFT loss-head shapes (N 8192, bf16): per-phase CUDA-event medians of
``leantrain.lm_head.ops`` against the GEMM floors, for a few fold and tile settings, and the scalar loss of a trainable
head at three chunk budgets. Only torch + leantrain: nothing to install on the GPU machine.

Rows (JSON lines, and ``$OUT/probe_lm_head.json``), per (H, V):
- ``floor2`` / ``floor3``: the 2 / 3 N x H x V GEMMs alone (logits materialized), the frozen / trainable floors.
- ``tiled_gemms``: the frozen path's own GEMM sequence (tile GEMM + fp32-accumulating GEMM per tile), no fold.
- ``fold``: the Triton fold + combine alone on one tile, as many times as the op has tiles (its whole fold cost; the
  tile is restored from a copy before each call, and the copies' time, ``copy_ms``, is subtracted).
- ``frozen``: ``token_stats`` fwd+bwd into hidden (entropy, top-1); ``frozen_fwd``: its forward with a graph;
  ``nograd_fwd``: its forward under no_grad; ``host_ms``: the CPU time to issue one fwd+bwd (no sync; above the GPU
  time means the GPU waits for Python).
- ``loss_trainable_<MiB>``: ``head_loss`` fwd+bwd of a trainable head with that chunk budget, peak memory above the
  inputs.
- at the Gemma shape: the fold per fold setting (``FOLD_BLOCK`` x ``FOLD_WARPS``), the frozen path with 65536-column
  tiles, and the trainable head at three chunk budgets (one, 1024 MiB, at the other shapes).
A measurement that fails (out of memory, a kernel error) is a row with ``error``; the run goes on.

    PYTHONPATH=src:benchmarks python3 benchmarks/probe_lm_head.py           # H100: under 90 s
    PYTHONPATH=src:benchmarks python3 benchmarks/probe_lm_head.py --smoke   # CPU, tiny shape, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from _harness import peak_memory, time_fn  # noqa: E402

from leantrain.lm_head import ops  # noqa: E402


FULL_SHAPES = [(8192, 2304, 256000), (8192, 1536, 151936), (8192, 4096, 128256)]
SMOKE_SHAPES = [(64, 32, 1000)]
FOLD_SETTINGS = [(2048, 4), (8192, 8)]  # besides the default (ops.FOLD_BLOCK, ops.FOLD_WARPS)
LOSS_MIB = (512, 1024, 2048)


def make_inputs(n: int, h: int, v: int, device: str, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g)
    weight = torch.randn(v, h, device=device, dtype=dtype, generator=g) * (4 / h**0.5)  # logit std ~4
    targets = torch.randint(0, v, (n,), device=device, generator=g)  # every row scored, as the floor's N
    return hidden, weight, targets


class Probe:
    def __init__(self, device: str, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.rows: list[dict] = []

    def ms(self, fn) -> float:
        return time_fn(lambda _i: fn(), warmup=self.warmup, reps=self.reps).p50

    def record(self, shape, what: str, **values) -> None:
        values = {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}
        row = dict(shape=list(shape), what=what, **values)
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def guard(self, shape, what: str, fn, *args) -> None:
        """One measurement; a failure is a row, not the end of the run."""
        try:
            fn(*args)
        except Exception as error:
            self.record(shape, what, error=f"{type(error).__name__}: {str(error)[:300]}")
            if self.device == "cuda":
                torch.cuda.empty_cache()


def floors(p: Probe, shape, hidden, weight) -> None:
    z = torch.empty(hidden.shape[0], weight.shape[0], device=hidden.device, dtype=hidden.dtype)

    def two():
        torch.mm(hidden, weight.t(), out=z)
        torch.mm(z, weight)

    def three():
        two()
        torch.mm(z.t(), hidden)

    p.record(shape, "floor2", ms=p.ms(two))
    p.record(shape, "floor3", ms=p.ms(three))


def tiled_gemms(p: Probe, shape, hidden, weight) -> None:
    """The frozen path's GEMMs alone: logits tile, then acc += tile @ w_tile in fp32."""
    n, width = hidden.shape
    vocab = weight.shape[0]
    rows, cols = ops.plan_tiles(n, vocab, 512, hidden.dtype.itemsize)
    buf = torch.empty(rows, cols, device=hidden.device, dtype=hidden.dtype)
    acc = torch.zeros(n, width, device=hidden.device, dtype=torch.float32)

    def run():
        for r0 in range(0, n, rows):
            for c0 in range(0, vocab, cols):
                tile = buf[: min(rows, n - r0), : min(cols, vocab - c0)]
                torch.mm(hidden[r0 : r0 + rows], weight[c0 : c0 + cols].t(), out=tile)
                ops._addmm_fp32(acc[r0 : r0 + rows], tile, weight[c0 : c0 + cols])

    p.record(shape, "tiled_gemms", ms=p.ms(run), tile=[rows, cols])


def fold_only(p: Probe, shape, hidden, weight, targets, label="fold") -> None:
    """The fold (+ combine) on one logits tile, launched as many times as the op has tiles."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cfg = ops.OpConfig(backend=ops.default_backend(hidden.device), compute_dtype=hidden.dtype, need_top1=True)
    rows, cols = ops.plan_tiles(n, vocab, 512, hidden.dtype.itemsize)
    tiles = -(-n // rows) * -(-vocab // cols)
    tile = torch.mm(hidden[:rows], weight[:cols].t())
    st = ops._Stats.empty(rows, hidden.device, True)
    ops._start_rows(st, hidden[:rows], weight, None, targets[:rows], cfg)
    acc = torch.zeros(rows, hidden.shape[1], device=hidden.device, dtype=torch.float32)
    fold = ops._fold_fn(cfg)
    logits = tile.clone()

    def copies():
        for _ in range(tiles):
            tile.copy_(logits)

    def run():  # the fold overwrites its tile: each call gets the logits back first (timed alone as tile_copy)
        for _ in range(tiles):
            tile.copy_(logits)
            fold(tile, targets[:rows], 0, st, cfg, True, None, (acc,))

    copy_ms = p.ms(copies)
    p.record(shape, label, ms=p.ms(run) - copy_ms, tiles=tiles, fold=[ops.FOLD_BLOCK, ops.FOLD_WARPS], copy_ms=copy_ms)


def frozen(p: Probe, shape, hidden, weight, targets, label="frozen", phases=True) -> None:
    h = hidden.detach().requires_grad_()

    def fwd():
        return ops.token_stats(h, weight, targets, need_top1=True)

    def fwd_bwd():
        fwd().logp.sum().backward()
        h.grad = None

    p.record(shape, label, ms=p.ms(fwd_bwd), peak_gib=peak_memory(fwd_bwd), fold=[ops.FOLD_BLOCK, ops.FOLD_WARPS],
             cols=ops.MAX_TILE_COLS)  # fmt: skip
    if not phases:
        return
    p.record(shape, "frozen_fwd", ms=p.ms(fwd))
    with torch.no_grad():
        p.record(shape, "nograd_fwd", ms=p.ms(fwd))
    if p.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd_bwd()  # issued without a sync: the CPU's own time
    host = (time.perf_counter() - t0) * 1e3
    if p.device == "cuda":
        torch.cuda.synchronize()
    p.record(shape, "host_ms", ms=host)


def trainable(p: Probe, shape, hidden, weight, targets, tile_mib: int) -> None:
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    scale = 1 / max(1, int((targets >= 0).sum()))

    def fwd_bwd():
        ops.head_loss(h, w, targets, loss_scale=scale, tile_mib=tile_mib).loss.backward()
        h.grad = w.grad = None

    rows = ops.plan_rows(hidden.shape[0], weight.shape[0], tile_mib, hidden.dtype.itemsize)
    p.record(shape, f"loss_trainable_{tile_mib}", ms=p.ms(fwd_bwd), peak_gib=peak_memory(fwd_bwd), chunk_rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU (torch backend), seconds")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if not args.smoke and device != "cuda":
        sys.exit("the probe needs CUDA; use --smoke on CPU")
    p = Probe(device, reps=2 if args.smoke else 4, warmup=1)  # the warm-up call compiles the kernels
    dtype = torch.bfloat16
    for i, shape in enumerate(SMOKE_SHAPES if args.smoke else FULL_SHAPES):
        hidden, weight, targets = make_inputs(*shape, device, dtype)
        p.guard(shape, "floors", floors, p, shape, hidden, weight)
        p.guard(shape, "tiled_gemms", tiled_gemms, p, shape, hidden, weight)
        p.guard(shape, "fold", fold_only, p, shape, hidden, weight, targets)
        p.guard(shape, "frozen", frozen, p, shape, hidden, weight, targets)
        for tile_mib in LOSS_MIB if i == 0 and not args.smoke else LOSS_MIB[1:2]:
            p.guard(shape, f"loss_trainable_{tile_mib}", trainable, p, shape, hidden, weight, targets, tile_mib)
        if i == 0:  # the other fold and tile settings at the first shape
            default = (ops.FOLD_BLOCK, ops.FOLD_WARPS)
            for ops.FOLD_BLOCK, ops.FOLD_WARPS in FOLD_SETTINGS:
                p.guard(shape, "fold_setting", fold_only, p, shape, hidden, weight, targets, "fold_setting")
            ops.FOLD_BLOCK, ops.FOLD_WARPS = default
            cols, ops.MAX_TILE_COLS = ops.MAX_TILE_COLS, 65536
            p.guard(shape, "frozen_cols65536", frozen, p, shape, hidden, weight, targets, "frozen_cols65536", False)
            ops.MAX_TILE_COLS = cols
        del hidden, weight, targets
        if device == "cuda":
            torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        Path(out, "probe_lm_head.json").write_text(json.dumps(p.rows, indent=1))


if __name__ == "__main__":
    main()
