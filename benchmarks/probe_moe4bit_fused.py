"""Fused 4-bit grouped GEMM probe (CUDA): whole-stack dequantize (bitsandbytes vs the kernel's own decode, gather
and select-tree lookups, bitwise checked) and the fused GEMM over tile configs vs grouped_mm on the dequantized stack
at gpt-oss-20b shapes. Results: benchmarks/results/moe4bit_fused_kernel.{json,md} (written by hand from its JSON).

    PYTHONPATH=src:/tmp/site python3 benchmarks/probe_moe4bit_fused.py    # ~50 s on an H100; JSON into $OUT
"""

import json
import os
import sys
from pathlib import Path

import bitsandbytes.functional as bnbf
import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import time_fn  # noqa: E402

from leantrain.moe4bit import _triton
from leantrain.moe4bit._grouped import grouped_mm
from leantrain.moe4bit._stacks import stack_from_quant_state


dev = torch.device("cuda")
E, K_TOP, H, INTER = 32, 4, 2880, 2880
torch.manual_seed(0)


def timeit(fn, reps=20):
    """Median CUDA-event milliseconds of ``fn()`` after 3 warm-up calls (the benchmarks' harness)."""
    return time_fn(lambda _i: fn(), reps=reps).p50


def stack(shape):
    w = torch.randn(shape, device=dev, dtype=torch.bfloat16) * 0.02
    packed, qs = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    return stack_from_quant_state(packed, qs)


gu, dn = stack((E, H, 2 * INTER)), stack((E, INTER, H))
out = []
for name, st in (("gate_up", gu), ("down", dn)):
    ref = st.dequantize(torch.bfloat16)
    row = dict(stack=name, bnb_ms=timeit(lambda: st.dequantize(torch.bfloat16)), gbytes=(ref.numel() * 2.5) / 1e9)
    for lk in ("tree", "gather"):
        for blk in (1024, 4096):
            _triton.DEQUANT_BLOCK = blk
            got = _triton.dequantize_4bit(st, torch.bfloat16, lk)
            row[f"triton_{lk}_{blk}_ms"] = timeit(lambda: _triton.dequantize_4bit(st, torch.bfloat16, lk))
            row[f"triton_{lk}_{blk}_bitwise"] = bool(torch.equal(got.view(torch.int16), ref.view(torch.int16)))
    print(json.dumps(row), flush=True)
    out.append(row)
CONFIGS = [
    (128, 64, 64, 4, 3, "tree"),
    (128, 64, 64, 4, 3, "gather"),
    (128, 256, 32, 8, 4, "tree"),
    (128, 256, 32, 8, 4, "gather"),
    (256, 64, 64, 8, 3, "tree"),
    (256, 128, 64, 8, 3, "tree"),
    (256, 128, 64, 8, 3, "gather"),
    (64, 64, 64, 4, 3, "gather"),
    (128, 128, 64, 8, 3, "gather"),
    (64, 128, 64, 4, 4, "gather"),
]
for tokens in (512, 4096):
    s = tokens * K_TOP
    idx = torch.randint(0, E, (s,), device=dev)
    offs = torch.bincount(idx, minlength=E).cumsum(0).to(torch.int32)
    for name, st, transpose in (("gate_up fwd", gu, False), ("gate_up dX", gu, True)):
        k, n = _triton.operand_shape(st, transpose)
        a = torch.randn(s, k, device=dev, dtype=torch.bfloat16)
        wq = st.dequantize(torch.bfloat16)
        mat_b = wq.transpose(1, 2) if transpose else wq
        row = dict(tokens=tokens, op=name, floor_ms=timeit(lambda: grouped_mm(a, mat_b, offs)))
        ref = grouped_mm(a, mat_b, offs).float()
        for c in CONFIGS:
            cfg = _triton.TileConfig(*c)
            try:
                t = timeit(lambda: _triton.grouped_mm_4bit(a, st, offs, transpose, tiles=cfg), reps=10)
                got = _triton.grouped_mm_4bit(a, st, offs, transpose, tiles=cfg).float()
                row[str(c)] = (round(t, 3), float((got - ref).abs().max() / ref.abs().max()))
            except Exception as e:
                row[str(c)] = repr(e)[:80]
        print(json.dumps(row), flush=True)
        out.append(row)
o = os.environ.get("OUT")
if o:
    json.dump(out, open(os.path.join(o, "probe_moe4bit_v2.json"), "w"), indent=1)
