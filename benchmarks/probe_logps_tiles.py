"""Fused log-prob tile shapes vs the two-GEMM floor at N=8192, H=2048, V=151936 (bf16), CUDA: each (rows, cols)
logits tile forced through ``ops.plan_tiles``; the tiled GEMMs alone and the whole op (frozen head fwd+bwd, no-grad
forward, trainable head). Results: benchmarks/results/grpo_logps_tiles.{json,md} (written by hand from its JSON).

    PYTHONPATH=src python3 benchmarks/probe_logps_tiles.py     # ~60 s on an H100; JSON into $OUT
"""

import json
import os

import torch
from _harness import time_fn  # noqa: E402

from leantrain.lm_head import ops


dev = torch.device("cuda")
N, H, V = 8192, 2048, 151936
g = torch.Generator(device=dev).manual_seed(0)
hidden = torch.randn(N, H, device=dev, dtype=torch.bfloat16, generator=g)
weight = torch.randn(V, H, device=dev, dtype=torch.bfloat16, generator=g) * (4 / H**0.5)
targets = torch.randint(0, V, (N,), device=dev, generator=g)


def timeit(fn, reps=10):
    """Median CUDA-event milliseconds of ``fn()`` after 3 warm-up calls (the benchmarks' harness)."""
    return time_fn(lambda _i: fn(), reps=reps).p50


def fwd_bwd(trainable=False):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_(trainable)
    lp, ent = ops.logp_entropy(h, w, targets, temperature=0.7)
    lp.sum().backward()


def nograd():
    with torch.no_grad():
        ops.logp_entropy(hidden, weight, targets, temperature=0.7)


orig = ops.plan_tiles
res = []
out = torch.empty(N, V, device=dev, dtype=torch.bfloat16)
floor1 = timeit(lambda: torch.mm(hidden, weight.t(), out=out))
print("gemm floor (one N x V GEMM) ms", floor1, flush=True)
# GEMM-only per tile shape: the time of GEMM1 on tiles (how cuBLAS efficiency depends on the tile)
for rows in (1024, 2048, 4096, 8192):
    for cols in (1024, 2048, 4096, 8192, 16384, 32768):
        if rows * cols * 2 > 512 * 2**20:
            continue
        ops.plan_tiles = lambda n, v, mib, b, rows=rows, cols=cols: (min(rows, n), min(cols, v))
        buf = torch.empty(rows, cols, device=dev, dtype=torch.bfloat16)
        acc = torch.zeros(rows, H, device=dev, dtype=torch.float32)

        def gemms():
            for r0 in range(0, N, rows):
                for c0 in range(0, V, cols):
                    c1 = min(c0 + cols, V)
                    t = buf[:, : c1 - c0]
                    torch.mm(hidden[r0 : r0 + rows], weight[c0:c1].t(), out=t)
                    torch.addmm(acc, t, weight[c0:c1], out_dtype=torch.float32, out=acc)

        row = dict(
            rows=rows,
            cols=cols,
            tile_mib=rows * cols * 2 / 2**20,
            two_gemms_ms=timeit(gemms, 5),
            fwd_bwd_ms=timeit(fwd_bwd, 5),
            nograd_ms=timeit(nograd, 5),
            trainable_ms=timeit(lambda: fwd_bwd(True), 3),
        )
        print(json.dumps(row), flush=True)
        res.append(row)
ops.plan_tiles = orig
print(
    json.dumps(
        dict(
            default=True,
            fwd_bwd_ms=timeit(fwd_bwd),
            nograd_ms=timeit(nograd),
            trainable_ms=timeit(lambda: fwd_bwd(True), 5),
        )
    ),
    flush=True,
)
o = os.environ.get("OUT")
if o:
    json.dump(dict(floor1=floor1, rows=res), open(os.path.join(o, "probe_logps_tiles.json"), "w"), indent=1)
