"""Probe (CUDA): one OSFT gradient-projection pass over every target of bench_osft's ~1.1B Llama (hidden 2048,
intermediate 8192, 16 layers, GQA k/v 512×2048; ``bench_osft.FULL`` / ``llama()``) at unfrozen ratio 0.5.

1. fp32 cuBLAS, tf32x3 cuBLAS split (the old path), tf32x3 Triton batched (one launch per shape class and
   product), tf32x3 Triton per target, one-pass TF32: median ms of one pass (CUDA events, 20 reps after warm-up)
   and the frozen-subspace residual max(|U_highᵀ dU′|, |dV′ V_highᵀ|) / max|d·| over all targets.
2. Tile sweep of the Triton kernel per shape class (batched over the 16 layers), best config per class.
3. Split-K sweep of one target's coefficient GEMM (the unbatched / sharded case) per class.
4. One batched pass per class with the kernel at tf32x3 / tf32 / ieee (what the split costs at few launches).
5. One target's four GEMMs per class through the kernel at tf32x3 / tf32 / ieee and through cuBLAS fp32 / TF32
   (beta 0: the update layouts' timing without the read of the target).

    python benchmarks/probe_osft_triton.py      # < 2 min on an H100; JSON into $OUT when set
    PROBE_SWEEP=wide python benchmarks/probe_osft_triton.py   # 17 tile configs instead of 6
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from _harness import time_fn  # noqa: E402
from bench_osft import FULL  # noqa: E402

from leantrain.osft import OSFTLinear, Projector, _triton  # noqa: E402
from leantrain.osft._triton import Operand, TileConfig  # noqa: E402
from leantrain.osft.ops import matmul_tf32  # noqa: E402


REPS, WARMUP = 20, 3
SWEEP = [
    TileConfig(128, 128, 32, 8, 3),
    TileConfig(128, 128, 32, 4, 3),
    TileConfig(128, 64, 32, 4, 4),
    TileConfig(64, 128, 32, 4, 4),
    TileConfig(128, 256, 32, 8, 3),
    TileConfig(128, 128, 64, 8, 2),
]
# PROBE_SWEEP=wide adds these (stages, warps, K depth, narrower N, L2 grouping around the default)
WIDE = [
    TileConfig(128, 64, 32, 4, 3),
    TileConfig(128, 64, 32, 4, 5),
    TileConfig(128, 64, 32, 8, 4),
    TileConfig(128, 64, 16, 4, 6),
    TileConfig(128, 64, 64, 4, 3),
    TileConfig(64, 64, 32, 4, 4),
    TileConfig(128, 32, 32, 4, 4),
    TileConfig(256, 64, 32, 8, 3),
    TileConfig(64, 64, 64, 4, 3),
    TileConfig(128, 64, 32, 4, 4, group_m=4),
    TileConfig(128, 64, 32, 4, 4, group_m=16),
]
SPLITS = (1, 2, 4, 8)


def target_shapes() -> dict[str, tuple[int, int]]:
    m = FULL["model"]
    hidden, inter, heads = m["hidden_size"], m["intermediate_size"], m["num_attention_heads"]
    kv = hidden // heads * (heads // 4)  # llama(): num_key_value_heads = heads // 4
    return {"q/o": (hidden, hidden), "k/v": (kv, hidden), "gate/up": (inter, hidden), "down": (hidden, inter)}


def per_layer(name: str) -> int:
    return 1 if name == "down" else 2


def make_layers(dev: torch.device) -> dict[str, list[OSFTLinear]]:
    """Per class, 16 layers' targets (each its own tensors; one random orthonormal factor set copied)."""
    out: dict[str, list[OSFTLinear]] = {}
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (n, m) in target_shapes().items():
        r = min(n, m)
        k = r // 2
        u = torch.linalg.qr(torch.randn(n, r, device=dev, generator=g))[0]
        v = torch.linalg.qr(torch.randn(m, r, device=dev, generator=g))[0].t()
        layers = []
        for _ in range(FULL["model"]["num_hidden_layers"] * per_layer(name)):
            layer = OSFTLinear(m, n, k, device=dev, dtype=torch.float32)
            with torch.no_grad():
                for f, value in dict(U_high=u[:, :k], U_low=u[:, k:], V_high=v[:k], V_low=v[k:]).items():
                    getattr(layer, f).copy_(value)
            layers.append(layer)
        out[name] = layers
    return out


def set_grads(layers: list[OSFTLinear], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=layers[0].U_low.device).manual_seed(seed)
    grads = []
    for layer in layers:
        du = torch.randn(layer.U_low.shape, device=layer.U_low.device, generator=g)
        dv = torch.randn(layer.V_low.shape, device=layer.U_low.device, generator=g)
        layer.U_low.grad, layer.V_low.grad = du.clone(), dv.clone()
        grads.append((du, dv))
    return grads


def time_ms(fn, reps: int = REPS, warmup: int = WARMUP) -> float:
    """Median CUDA-event milliseconds of ``fn()`` after ``warmup`` calls (the benchmarks' harness)."""
    return time_fn(lambda _i: fn(), warmup=warmup, reps=reps).p50


def residual(layers: list[OSFTLinear], grads) -> float:
    worst = 0.0
    for layer, (du, dv) in zip(layers, grads):
        u, v = layer.U_high.double(), layer.V_high.double()
        ru = (u.t() @ layer.U_low.grad.double()).abs().max() / du.abs().max()
        rv = (layer.V_low.grad.double() @ v.t()).abs().max() / dv.abs().max()
        worst = max(worst, float(ru), float(rv))
    return worst


VARIANTS = {
    "fp32 cuBLAS": dict(precision="fp32"),
    "tf32x3 split (cuBLAS)": dict(precision="tf32x3", kernel="split"),
    "tf32x3 Triton batched": dict(precision="tf32x3", kernel="triton"),
    "tf32x3 Triton per target": dict(precision="tf32x3", kernel="triton", bucket_mib=0),  # one target per bucket
    "tf32 one pass": dict(precision="tf32"),
}


def compare(all_layers: list[OSFTLinear]) -> dict[str, dict]:
    results = {}
    for label, kw in VARIANTS.items():
        projector = Projector(all_layers, **kw)
        grads = set_grads(all_layers)
        projector.project_gradients()
        res = residual(all_layers, grads)
        ms = time_ms(projector.project_gradients)
        results[label] = {"ms": ms, "residual": res, "fallbacks": dict(projector.fallbacks)}
        print(
            f"{label:28s} {ms:9.2f} ms/pass   residual {res:.2e}   fallbacks {projector.fallbacks or '-'}", flush=True
        )
    return results


def sweep_tiles(classes: dict[str, list[OSFTLinear]]) -> dict[str, list]:
    out: dict[str, list] = {}
    default = _triton.default_tiles
    try:
        for name, layers in classes.items():
            set_grads(layers)
            projector = Projector(layers, precision="tf32x3", kernel="triton")
            rows = []
            for tiles in SWEEP + (WIDE if os.environ.get("PROBE_SWEEP") == "wide" else []):
                _triton.default_tiles = lambda device, tiles=tiles: tiles
                try:
                    ms = time_ms(projector.project_gradients, reps=10, warmup=2)
                except Exception as error:  # e.g. out of shared memory for this config
                    ms = float("nan")
                    print(f"  {name} {tiles}: failed {type(error).__name__}: {str(error)[:120]}")
                rows.append((dataclasses.asdict(tiles), ms))
            best = min((r for r in rows if r[1] == r[1]), key=lambda r: r[1], default=None)
            print(f"{name:8s} " + "  ".join(f"{tuple(t.values())[:5]}={ms:.2f}" for t, ms in rows), flush=True)
            print(f"{name:8s} best {best}", flush=True)
            out[name] = rows
    finally:
        _triton.default_tiles = default
    return out


def batched_precisions(classes: dict[str, list[OSFTLinear]]) -> dict[str, dict]:
    """One batched gradient pass per class with the kernel forced to tf32x3 / tf32 / ieee: what the in-register
    split costs over one TF32 pass when launches are few (the per-target rows below are launch-bound)."""
    out: dict[str, dict] = {}
    addmm = _triton.addmm
    try:
        for name, layers in classes.items():
            set_grads(layers)
            projector = Projector(layers, precision="tf32x3", kernel="triton")
            row = {}
            for precision in _triton.PRECISIONS:
                _triton.addmm = lambda *a, p=precision, **kw: addmm(*a, **{**kw, "precision": p})  # noqa: E731
                row[precision] = time_ms(projector.project_gradients, reps=10, warmup=2)
            print(f"{name:8s} batched pass: " + "  ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
            out[name] = row
    finally:
        _triton.addmm = addmm
    return out


def sweep_split_k(classes: dict[str, list[OSFTLinear]]) -> dict[str, list]:
    """One target's coefficient GEMMs (u: U_highᵀ·dU, v: dV·V_highᵀ) with split-K 1/2/4/8 (and the heuristic)."""
    out: dict[str, list] = {}
    for name, layers in classes.items():
        layer = layers[0]
        du, dv = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
        for side, a, b in (("u", layer.U_high.detach().t(), du), ("v", dv, layer.V_high.detach().t())):
            c = torch.empty(a.shape[0], b.shape[1], device=a.device)
            rows = []
            for split in (None, *SPLITS):
                ms = time_ms(lambda split=split: _triton.addmm(Operand(c), a, b, split_k=split), reps=10, warmup=2)
                rows.append((split or "auto", ms))
            print(f"{name:8s} {side} coefficient {tuple(c.shape)} K={a.shape[1]}: "
                  + "  ".join(f"split {s}={ms:.3f}" for s, ms in rows), flush=True)  # fmt: skip
            out[f"{name} {side}"] = rows
    return out


def precisions(classes: dict[str, list[OSFTLinear]]) -> dict[str, dict]:
    """The same Triton kernel at tf32x3 / tf32 / ieee (and cuBLAS fp32, TF32) on one target's four GEMMs per
    class: what the in-register split costs over one TF32 pass, per layout."""
    out: dict[str, dict] = {}
    for name, layers in classes.items():
        layer = layers[0]
        u_high, v_high = layer.U_high.detach(), layer.V_high.detach()
        du, dv = torch.randn_like(layer.U_low), torch.randn_like(layer.V_low)
        cu = torch.empty(u_high.shape[1], du.shape[1], device=du.device)
        cv = torch.empty(dv.shape[0], v_high.shape[0], device=dv.device)
        gemms = {"u coeff": (cu, u_high.t(), du), "u update": (du, u_high, cu),
                 "v coeff": (cv, dv, v_high.t()), "v update": (dv, cv, v_high)}  # fmt: skip
        for what, (c, a, b) in gemms.items():
            row = {}
            for precision in _triton.PRECISIONS:
                call = lambda c=c, a=a, b=b, p=precision: _triton.addmm(c, a, b, precision=p)  # noqa: E731
                row[precision] = time_ms(call, reps=10, warmup=2)
            for label, tf32 in (("cuBLAS fp32", False), ("cuBLAS tf32", True)):
                with matmul_tf32(tf32):
                    row[label] = time_ms(lambda c=c, a=a, b=b: torch.mm(a, b, out=c), reps=10, warmup=2)
            print(f"{name:8s} {what:9s} {tuple(a.shape)}@{tuple(b.shape)}: "
                  + "  ".join(f"{k}={v:.3f}" for k, v in row.items()), flush=True)  # fmt: skip
            out[f"{name} {what}"] = row
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    start = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {_triton.triton.__version__}")
    classes = make_layers(dev)
    all_layers = [layer for layers in classes.values() for layer in layers]
    print(
        f"{len(all_layers)} targets: " + ", ".join(f"{k} {target_shapes()[k]} x{len(v)}" for k, v in classes.items())
    )
    report = {"compare": compare(all_layers)}
    print(f"compare done at {time.perf_counter() - start:.0f} s", flush=True)
    report["tiles"] = sweep_tiles(classes)
    print(f"tile sweep done at {time.perf_counter() - start:.0f} s", flush=True)
    report["batched_precisions"] = batched_precisions(classes)
    report["split_k"] = sweep_split_k(classes)
    report["precisions"] = precisions(classes)
    print(f"wall {time.perf_counter() - start:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_osft_triton.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
