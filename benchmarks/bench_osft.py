"""OSFT benchmark: projection, factored linear, whole training step; leantrain vs mini_trainer 0.9.0 vs PEFT OSF.

1. Projection of one target's gradients (U and V; and V alone, the anchor shape), Llama-3.1-8B shapes 4096×4096,
   14336×4096, 4096×14336 at unfrozen ratio 0.5: leantrain factored (fp32, TF32, bf16 factors, and the split
   tf32x3 / bf16x3 products, leantrain only; tf32x3 runs the Triton GEMM that splits in registers on CUDA,
   tf32x3_split the three cuBLAS GEMMs over split copies) vs the Gram form vs
   mini_trainer 0.9.0's ``project_gradient_to_orthogonal_space`` vs PEFT's; with the residual left in the frozen
   subspace, max(|U_highᵀ dU′|, |dV′ V_highᵀ|) / max|d·|, per precision (what TF32 costs in orthogonality).
2. Forward + backward of one factored linear, 16,384 tokens, bf16: leantrain ``OSFTLinear`` (eager and compiled)
   vs mini_trainer's ``_factorized_linear`` vs PEFT's OSF ``Linear`` (dense base + delta; its backward hooks
   project per micro-batch) vs a dense ``nn.Linear``.
3. Training step of a ~1B Llama shape (hidden 2048, 16 layers, vocab 32000), batch 4×2048, fp32 master weights
   under bf16 autocast (the HF Trainer ``bf16=True`` setup), AdamW: dense vs leantrain OSFT (projection GEMMs
   tf32x3 (Triton on CUDA), tf32x3 cuBLAS split, fp32, one-pass TF32, bf16x3) vs mini_trainer 0.9.0 (same factors,
   its own forward and ``optim_wrapper`` projections).
   Tokens/s, peak memory, projection time, frozen/trainable max |cos| after the timed steps.

    python benchmarks/bench_osft.py            # CUDA, full size (< 4 min on an H100)
    python benchmarks/bench_osft.py --smoke    # CPU, tiny shapes (< 60 s)
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_osft.py --fsdp2   # 2 GPUs, FSDP2

``--fsdp2`` runs section 3 under FSDP2 (blocks and root sharded): dense; leantrain with ``leantrain.osft.fully_shard``
(V on Shard(1): one all-reduce per bucket of coefficients); leantrain on FSDP's default Shard(0) (V_high
all-gathered per bucket, or once with ``cache_v_high``); mini_trainer 0.9.0 on Shard(0) (its per-target V
all-gathers). Step time, projection time, peak memory per rank, orthogonality.

mini_trainer is imported from an installed ``mini_trainer`` or from ``rhai_innovation_mini_trainer-0.9.0`` wheel in
``.whl/`` (its ``osft_utils`` module alone, under a stub package: the package ``__init__`` imports numba and more);
a peer that fails to import is skipped with the reason in the table. Writes ``bench_osft[_fsdp2].json/.md/.png``
into ``$BENCH_RESULTS`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import os
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import shapes  # noqa: E402
import torch
import torch.distributed as dist
from _harness import RESULTS, Row, bar_plot, markdown_table, time_fn, write_results  # noqa: E402
from torch import nn

from leantrain.osft import OSFTLinear, Projector, convert, frozen_overlap, fully_shard, osft_layers  # noqa: E402
from leantrain.osft.ops import gram_project, matmul_tf32  # noqa: E402


ROOT = Path(__file__).resolve().parent.parent
LLAMA_1B = shapes.config("llama-3.2-1b")


def sizes(fields: dict, *keys: str) -> dict:
    return {k: fields[k] for k in keys}


BENCH = "bench_osft"
FULL = {
    "shapes": [(4096, 4096), (14336, 4096), (4096, 14336)],
    "tokens": 16384,
    # Llama-3.2-1B's decoder sizes (benchmarks/shapes.py) with a 32000 vocab, untied (the "1.1B Llama" of the records)
    "model": sizes(LLAMA_1B, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
    "vocab": 32000,
    "batch": (4, 2048),
    "reps": 20,
    "steps": (2, 8),  # warm-up, timed
}
# Projection GEMMs (fp32 factors unless "bf16"): fp32 exact; tf32 / bf16 one reduced-precision pass; tf32x3 /
# bf16x3 hi·hi + hi·lo + lo·hi split products. tf32x3 runs the Triton GEMM that splits in registers (kernel "auto":
# on CUDA), tf32x3_split the three cuBLAS GEMMs over split copies (both timed in the same run; on CPU both take the
# emulated split).
PROJECTION_PRECISIONS = ("fp32", "tf32", "bf16", "tf32x3", "tf32x3_split", "bf16x3")
TRAIN_PRECISIONS = {
    "leantrain": "tf32x3",
    "leantrain_tf32x3splitproj": "tf32x3_split",
    "leantrain_fp32proj": "fp32",
    "leantrain_tf32proj": "tf32",
    "leantrain_bf16x3proj": "bf16x3",
}
EMULATE = not torch.cuda.is_available()  # --smoke on CPU: reduced-precision GEMMs emulated (residuals meaningful)
SMOKE = {
    "shapes": [(96, 96), (160, 96), (96, 160)],
    "tokens": 256,
    "model": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "vocab": 512,
    "batch": (2, 64),
    "reps": 3,
    "steps": (1, 2),
}


# -- peers ---------------------------------------------------------------------------------------------------------


def load_mini_trainer() -> tuple[Any, str]:
    """(mini_trainer.osft_utils or None, reason). Imports only ``osft_utils`` and its four sibling modules."""
    try:
        return importlib.import_module("mini_trainer.osft_utils"), "installed"
    except Exception:
        sys.modules.pop("mini_trainer", None)
    wheels = sorted(ROOT.glob(".whl*/rhai_innovation_mini_trainer-0.9.0-*.whl"))  # .whl/ or .whl_osft/
    if not wheels:
        return None, "not installed and no rhai_innovation_mini_trainer-0.9.0 wheel in .whl*/"
    target = Path(tempfile.mkdtemp(prefix="mini_trainer_"))
    with zipfile.ZipFile(wheels[-1]) as archive:
        archive.extractall(target)
    try:
        importlib.import_module("rich.logging")
    except ImportError:  # mini_trainer.utils only uses rich for a log handler
        rich, rich_logging = types.ModuleType("rich"), types.ModuleType("rich.logging")
        rich_logging.RichHandler = logging.StreamHandler
        sys.modules.update({"rich": rich, "rich.logging": rich_logging})
    package = types.ModuleType("mini_trainer")
    package.__path__ = [str(target / "mini_trainer")]
    sys.modules["mini_trainer"] = package
    try:
        return importlib.import_module("mini_trainer.osft_utils"), f"osft_utils from {wheels[-1].name}"
    except Exception as error:
        return None, f"import failed: {type(error).__name__}: {error}"


def load_peft_osf() -> tuple[Any, str]:
    try:
        from peft import OSFConfig
        from peft.tuners.osf import layer, utils

        return types.SimpleNamespace(OSFConfig=OSFConfig, Linear=layer.Linear, utils=utils), "peft"
    except Exception as error:
        return None, f"import failed: {type(error).__name__}: {error}"


# -- helpers -------------------------------------------------------------------------------------------------------


def projector_options(variant: str) -> dict[str, str]:
    """Projector keywords of a PROJECTION_PRECISIONS / TRAIN_PRECISIONS variant ("<precision>[_triton|_split]")."""
    precision, _, kernel = variant.partition("_")
    return {"precision": precision, "kernel": kernel or "auto"}


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def orthonormal(n: int, r: int, dev: torch.device, g: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, r, device=dev, generator=g))[0]


def factors(n: int, m: int, dev: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random exact factors (QR, no SVD): U (N, r), V (r, M), S descending; k_high = r/2 (unfrozen ratio 0.5)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    r = min(n, m)
    k = r // 2
    u, v = orthonormal(n, r, dev, g), orthonormal(m, r, dev, g).t().contiguous()
    s = torch.linspace(2.0, 0.1, r, device=dev)
    return {"U_high": u[:, :k], "S_high": s[:k], "V_high": v[:k], "U_low": u[:, k:], "S_low": s[k:], "V_low": v[k:]}


def make_layer(f: dict[str, torch.Tensor], dtype: torch.dtype) -> OSFTLinear:
    n, m, k = f["U_high"].shape[0], f["V_high"].shape[1], f["U_high"].shape[1]
    layer = OSFTLinear(m, n, k, device=f["U_high"].device, dtype=dtype)
    with torch.no_grad():
        for name, value in f.items():
            getattr(layer, name).copy_(value)
    return layer


def residual(f: dict[str, torch.Tensor], du: torch.Tensor, dv: torch.Tensor, du0, dv0) -> float:
    """Frozen-subspace residual of projected gradients, fp64, relative to the input's max."""
    u, v = f["U_high"].double(), f["V_high"].double()
    ru = (u.t() @ du.double()).abs().max() / du0.abs().max()
    rv = (dv.double() @ v.t()).abs().max() / dv0.abs().max()
    return float(max(ru, rv))


def svd_dict(f: dict[str, torch.Tensor], dtype: torch.dtype, trainable: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {k: v.to(dtype).contiguous() for k, v in f.items()}
    for k in ("U_low", "S_low", "V_low"):
        out[k] = nn.Parameter(out[k], requires_grad=trainable)
    out["rank_high"] = f["U_high"].shape[1]
    return out


# -- 1. projection -------------------------------------------------------------------------------------------------


def bench_projection(cfg: dict, rows: list[Row], mt: Any, peft: Any) -> None:
    dev = device()
    for n, m in cfg["shapes"]:
        f32 = factors(n, m, dev)
        g = torch.Generator(device=dev).manual_seed(1)
        du0 = torch.randn(f32["U_low"].shape, device=dev, generator=g)
        dv0 = torch.randn(f32["V_low"].shape, device=dev, generator=g)
        shape = f"{n}x{m}"
        for precision in PROJECTION_PRECISIONS:
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            tf32 = precision == "tf32"
            f = {k: v.to(dtype) for k, v in f32.items()}
            layer = make_layer(f32, dtype)
            # "bf16": bf16 factors (their own GEMMs); "tf32x3" / "bf16x3": fp32 factors, split reduced-precision GEMMs
            options = projector_options("fp32" if precision == "bf16" else precision)
            projector = Projector([layer], emulate=EMULATE, **options)

            def leantrain_call(i: int, layer=layer, projector=projector, dtype=dtype) -> None:
                layer.U_low.grad, layer.V_low.grad = du0.to(dtype), dv0.to(dtype)
                projector.project_gradients()

            def gram_call(i: int, f=f, dtype=dtype, tf32=tf32) -> tuple[torch.Tensor, torch.Tensor]:
                with matmul_tf32(tf32):
                    return gram_project(du0.to(dtype), dv0.to(dtype), f["U_high"], f["V_high"])

            def v_only(i: int, f=f, dtype=dtype, tf32=tf32) -> None:
                dv = dv0.to(dtype)
                with matmul_tf32(tf32):
                    dv.addmm_(torch.mm(dv, f["V_high"].t()), f["V_high"], alpha=-1)

            def v_gram(i: int, f=f, dtype=dtype, tf32=tf32) -> None:
                with matmul_tf32(tf32):
                    dv0.to(dtype) @ (f["V_high"].t() @ f["V_high"])

            calls: dict[str, Callable[[int], Any]] = {"leantrain": leantrain_call, "gram": gram_call}
            split = "x3" in precision  # leantrain only: the peers have no split-precision mode
            if split:
                del calls["gram"]
            if mt is not None and not split:
                sd = svd_dict(f32, dtype)

                def mt_call(i: int, sd=sd, dtype=dtype, tf32=tf32) -> None:
                    sd["U_low"].grad, sd["V_low"].grad = du0.to(dtype), dv0.to(dtype)
                    with matmul_tf32(tf32):
                        mt.project_gradient_to_orthogonal_space(sd)

                calls["mini_trainer"] = mt_call
            if peft is not None and not split:
                psd = svd_dict(f32, dtype)

                def peft_call(i: int, sd=psd, dtype=dtype, tf32=tf32) -> None:
                    sd["U_low"].grad, sd["V_low"].grad = du0.to(dtype), dv0.to(dtype)
                    with matmul_tf32(tf32):
                        peft.utils.project_gradient_to_orthogonal_space(sd)

                calls["peft_utils"] = peft_call
            for provider, call in calls.items():
                t = time_fn(call, warmup=3, reps=cfg["reps"])
                out = call(0)
                if provider == "leantrain":
                    du, dv = layer.U_low.grad, layer.V_low.grad
                elif provider == "gram":
                    du, dv = out
                else:
                    chosen = sd if provider == "mini_trainer" else psd
                    du, dv = chosen["U_low"].grad, chosen["V_low"].grad
                res = residual(f32, du, dv, du0, dv0)
                rows.append(Row.timing(BENCH, provider, "projection U+V", "shape", shape, t, precision=precision))
                rows.append(Row(BENCH, provider, "projection U+V", "quality", "residual", "shape", shape, res,
                                config={"precision": precision}))  # fmt: skip
            for provider, call in () if split else (("leantrain", v_only), ("gram", v_gram)):
                t = time_fn(call, warmup=3, reps=cfg["reps"])
                rows.append(Row.timing(BENCH, provider, "projection V", "shape", shape, t, precision=precision))
        empty_cache()


# -- 2. factored linear forward + backward -------------------------------------------------------------------------


def bench_linear(cfg: dict, rows: list[Row], mt: Any, peft: Any) -> None:
    dev = device()
    dtype = torch.bfloat16
    tokens = cfg["tokens"]
    for n, m in cfg["shapes"]:
        f = factors(n, m, dev)
        shape = f"{n}x{m}"
        x = torch.randn(tokens, m, device=dev, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, n, device=dev, dtype=dtype)
        dense = nn.Linear(m, n, bias=False, device=dev, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_((f["U_high"] * f["S_high"]) @ f["V_high"] + (f["U_low"] * f["S_low"]) @ f["V_low"])
        layer = make_layer(f, dtype)
        fwds: dict[str, Callable[[], torch.Tensor]] = {"dense": lambda: dense(x), "leantrain": lambda: layer(x)}
        if torch.cuda.is_available() and (n, m) == cfg["shapes"][0]:  # one compile keeps the run short
            compiled = torch.compile(layer, fullgraph=True)
            fwds["leantrain_compiled"] = lambda: compiled(x)
        if mt is not None:
            sd = svd_dict(f, dtype)
            forward = mt.create_osft_model_class(nn.Module)._factorized_linear
            fwds["mini_trainer"] = lambda: forward(None, x, sd)
        if peft is not None:
            try:
                base = copy.deepcopy(dense).requires_grad_(False)  # PEFT freezes the base layer
                config = peft.OSFConfig(effective_rank=f["U_high"].shape[1])
                peft_layer = peft.Linear(base, "default", config=config, effective_rank=f["U_high"].shape[1])
                fwds["peft_osf"] = lambda: peft_layer(x)
            except Exception as error:
                rows.append(Row(BENCH, "peft_osf", "fwd+bwd", "skipped", str(error)[:200], "shape", shape, 0.0))
        for provider, fwd in fwds.items():

            def step(i: int, fwd=fwd) -> None:
                fwd().backward(grad)

            t = time_fn(step, warmup=3, reps=cfg["reps"])
            rows.append(Row.timing(BENCH, provider, "fwd+bwd", "shape", shape, t, tokens=tokens, dtype="bf16"))
        fwds.clear()
        empty_cache()


# -- 3. training step ----------------------------------------------------------------------------------------------


def llama(cfg: dict) -> nn.Module:
    import transformers

    model_cfg = dict(cfg["model"])
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"],
        num_key_value_heads=model_cfg["num_attention_heads"] // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **model_cfg,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device()):  # random init on the GPU: seconds instead of a minute on CPU
        return transformers.LlamaForCausalLM(config)


def mini_trainer_model(mt: Any, dense: nn.Module, layers: dict[str, OSFTLinear]) -> nn.Module:
    """mini_trainer's OSFT model class around the same config, with leantrain's factors and the same other weights
    (no second SVD): its forward closures and projections, our starting point."""
    import transformers

    cls = mt.create_osft_model_class(transformers.LlamaForCausalLM)
    with torch.device(device()):
        model = cls(dense.config, osft_config={}, initialize_osft=False, upcast_dtype=torch.float32)
    model.load_state_dict(dense.state_dict())
    model.osft_config = {f"{name}.weight": layer.k_high for name, layer in layers.items()}
    model.reinitialize_osft(decompose_existing_weights=False)
    with torch.no_grad():
        for name, layer in layers.items():
            module = model.get_submodule(name)
            for f in ("U_high", "S_high", "V_high"):
                getattr(module, f"osft_{f}").copy_(getattr(layer, f))
            for f in ("U_low", "S_low", "V_low"):
                getattr(module.osft_params, f).copy_(getattr(layer, f))
    return model


def mt_overlap(model: nn.Module) -> float:
    """leantrain's frozen/trainable max |cos| on mini_trainer's factors (same metric, duck-typed)."""
    worst = 0.0
    for module in model.modules():
        if hasattr(module, "osft_params") and hasattr(module, "osft_U_high"):
            low = module.osft_params
            view = types.SimpleNamespace(
                k_high=module.osft_U_high.shape[1], U_high=module.osft_U_high, V_high=module.osft_V_high,
                U_low=low.U_low, V_low=low.V_low,
            )  # fmt: skip
            worst = max(worst, frozen_overlap(view))
    return worst


PROFILE: dict[str, Path] = {}  # {"dir": where --profile writes its summaries}; empty: no profiling


def train_steps(
    model: nn.Module,
    cfg: dict,
    before: Callable[[], None],
    after: Callable[[], None],
    autocast: bool = True,
    profile_as: str | None = None,
) -> dict[str, float]:
    """Median step (forward, backward, ``before``, AdamW, ``after``); bf16 autocast over fp32 weights unless FSDP2's
    mixed-precision policy already casts. With ``--profile`` (and a ``profile_as`` name) 3 more steps run under
    the torch profiler after the timed ones: see ``profile_steps``."""
    dev = device()
    rank = dist.get_rank() if dist.is_initialized() else 0
    batch, length = cfg["batch"]
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    data = [torch.randint(0, cfg["vocab"], (batch, length), device=dev, generator=g) for _ in range(4)]
    params = [p for p in model.parameters() if p.requires_grad]
    fused = torch.cuda.is_available() and not dist.is_initialized()
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=fused or None, foreach=None if fused else True)
    cast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast)
    losses: list[float] = []
    proj_ms: list[float] = []

    def step(i: int) -> None:
        ids = data[i % len(data)]
        with cast, torch.profiler.record_function("phase: forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with torch.profiler.record_function("phase: backward"):
            loss.backward()
        t0 = time.perf_counter()
        with torch.profiler.record_function("phase: project gradients"):
            before()
        with torch.profiler.record_function("phase: optimizer"):
            optimizer.step()
        with torch.profiler.record_function("phase: project parameters"):
            after()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        proj_ms.append((time.perf_counter() - t0) * 1e3)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    warmup, timed = cfg["steps"]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = time_fn(step, warmup=warmup, reps=timed)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    median_ms = sorted(proj_ms)[len(proj_ms) // 2]
    if PROFILE and profile_as:
        profile_steps(step, profile_as, rank)
    return {"timing": t, "peak_gib": peak, "loss": float(losses[-1]), "opt_proj_ms": median_ms}


def profile_steps(step: Callable[[int], None], name: str, rank: int) -> None:
    """3 steps under the torch profiler; rank 0 writes the top 30 ops and kernels by device time and the phases
    (forward, backward, gradient projection, optimizer, parameter projection) to ``<dir>/profile_<name>.txt``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for i in range(3):
            step(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if rank != 0:
        return
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    events = prof.key_averages()
    phases = [e for e in events if e.key.startswith("phase: ")]
    lines = [f"# {name}: 3 steps; per phase, host and device time per step; the top 30 by self device time", ""]
    lines += [
        f"{e.key:<32} host {e.cpu_time_total / 3e3:8.1f} ms  device {getattr(e, 'device_time_total', 0) / 3e3:8.1f} ms"
        for e in phases
    ]
    lines += ["", events.table(sort_by=sort, row_limit=30, max_name_column_width=70)]
    PROFILE["dir"].mkdir(parents=True, exist_ok=True)
    (PROFILE["dir"] / f"profile_{name}.txt").write_text("\n".join(lines))


def bench_training(cfg: dict, rows: list[Row], mt: Any, mt_reason: str) -> None:
    dev = device()
    batch, length = cfg["batch"]
    tokens = batch * length
    base = llama(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    x = f"{n_params / 1e9:.2f}B, {batch}x{length}"
    nothing = lambda: None  # noqa: E731
    results: dict[str, dict[str, float]] = {}

    dense = copy.deepcopy(base).to(dev).train()
    results["dense"] = train_steps(dense, cfg, nothing, nothing)
    del dense

    model = copy.deepcopy(base).to(dev).train()
    t0 = time.perf_counter()
    conversion = convert(model, unfrozen_rank_ratio=0.5, progress=False)
    svd_s = time.perf_counter() - t0
    layers = conversion.layers
    cpu_layers = {n: copy.deepcopy(layer).cpu() for n, layer in layers.items()} if mt is not None else {}
    for label, precision in TRAIN_PRECISIONS.items():
        projector = Projector(list(layers.values()), emulate=EMULATE, **projector_options(precision))
        results[label] = train_steps(model, cfg, projector.project_gradients, projector.project_parameters)
        results[label]["overlap"] = max(frozen_overlap(layer) for layer in layers.values())
    del model, layers, conversion

    if mt is not None:
        try:
            mt_model = mini_trainer_model(mt, base, cpu_layers).to(dev).train()
            mt_model.upcast_dtype = torch.float32
            results["mini_trainer"] = train_steps(
                mt_model, cfg, mt_model.project_gradients, mt_model.project_parameters
            )
            results["mini_trainer"]["overlap"] = mt_overlap(mt_model)
            del mt_model
        except Exception as error:
            mt_reason = f"failed: {type(error).__name__}: {error}"
    for provider, r in results.items():
        t = r["timing"]
        common = dict(tokens=tokens, svd_s=svd_s, opt_proj_ms=r["opt_proj_ms"], loss=r["loss"])
        rows.append(Row.timing(BENCH, provider, "train step", "model", x, t, **common))
        rows.append(Row(BENCH, provider, "train step", "throughput", "tokens/s", "model", x, tokens / t.p50 * 1e3))
        rows.append(Row(BENCH, provider, "train step", "memory", "GiB", "model", x, r["peak_gib"]))
        if "overlap" in r:
            rows.append(Row(BENCH, provider, "train step", "quality", "max|cos|", "model", x, r["overlap"]))
    if "mini_trainer" not in results:
        rows.append(Row(BENCH, "mini_trainer", "train step", "skipped", mt_reason[:200], "model", x, 0.0))


# -- FSDP2 ---------------------------------------------------------------------------------------------------------


def bench_fsdp2(cfg: dict, mt: Any, mt_reason: str) -> list[Row]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")  # gloo: the --smoke check of this path on CPU
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device().type, (world,))
    batch, length = cfg["batch"]
    tokens = batch * length * world
    base = llama(cfg)
    x = f"{sum(p.numel() for p in base.parameters()) / 1e9:.2f}B, {world}x{batch}x{length}"
    rows: list[Row] = []
    nothing = lambda: None  # noqa: E731

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def shard(model: nn.Module, how: Callable[..., Any]) -> nn.Module:
        for block in model.model.layers:
            how(block, mesh=mesh, mp_policy=policy)
        how(model, mesh=mesh, mp_policy=policy)
        return model

    def record(provider: str, r: dict[str, float]) -> None:
        peaks = [None] * world
        dist.all_gather_object(peaks, r["peak_gib"])
        t = r["timing"]
        common = dict(tokens=tokens, opt_proj_ms=r["opt_proj_ms"], loss=r["loss"], peak_gib_per_rank=peaks)
        rows.append(Row.timing(BENCH, provider, "fsdp2 step", "model", x, t, **common))
        rows.append(Row(BENCH, provider, "fsdp2 step", "throughput", "tokens/s", "model", x, tokens / t.p50 * 1e3))
        rows.append(Row(BENCH, provider, "fsdp2 step", "memory", "GiB (max rank)", "model", x, max(peaks)))
        if "overlap" in r:
            rows.append(Row(BENCH, provider, "fsdp2 step", "quality", "max|cos|", "model", x, r["overlap"]))

    dense = shard(copy.deepcopy(base).train(), torch_fully_shard)
    record("dense", train_steps(dense, cfg, nothing, nothing, autocast=False, profile_as="fsdp2_dense"))
    del dense
    cpu_layers = None
    variants = (
        ("leantrain_shard1", fully_shard, False),
        ("leantrain_shard0", torch_fully_shard, False),
        ("leantrain_shard0_cached", torch_fully_shard, True),  # V_high gathered once (osft_cache_v_high)
    )
    for provider, how, cache_v_high in variants:
        model = copy.deepcopy(base).train()
        conversion = convert(model, unfrozen_rank_ratio=0.5, progress=rank == 0)  # round-robin SVD + broadcast
        if cpu_layers is None and mt is not None:
            cpu_layers = {n: copy.deepcopy(layer).cpu() for n, layer in conversion.layers.items()}
        shard(model, how)
        layers = list(osft_layers(model).values())
        projector = Projector(layers, cache_v_high=cache_v_high)
        r = train_steps(
            model,
            cfg,
            projector.project_gradients,
            projector.project_parameters,
            autocast=False,
            profile_as=f"fsdp2_{provider}",
        )
        r["overlap"] = max(frozen_overlap(layer) for layer in layers)
        record(provider, r)
        del model, conversion, layers, projector
        empty_cache()
    if mt is not None and cpu_layers is not None:
        try:
            mt_model = shard(mini_trainer_model(mt, base, cpu_layers).to(device()).train(), torch_fully_shard)
            r = train_steps(
                mt_model,
                cfg,
                mt_model.project_gradients,
                mt_model.project_parameters,
                autocast=False,
                profile_as="fsdp2_mini_trainer_shard0",
            )
            r["overlap"] = mt_overlap(mt_model)
            record("mini_trainer_shard0", r)
        except Exception as error:
            rows.append(Row(BENCH, "mini_trainer", "fsdp2 step", "skipped", str(error)[:200], "model", x, 0.0))
    else:
        rows.append(Row(BENCH, "mini_trainer", "fsdp2 step", "skipped", mt_reason[:200], "model", x, 0.0))
    return rows


# -- output --------------------------------------------------------------------------------------------------------


def summary(rows: list[Row]) -> str:
    """Throughput ratios of the step benchmarks (leantrain vs mini_trainer and vs dense)."""
    lines = []
    for mode in ("train step", "fsdp2 step"):
        tput = {r.provider: r.p50 for r in rows if r.mode == mode and r.unit == "tokens/s"}
        peers = [p for p in tput if p.startswith("mini_trainer")]
        for mine in (p for p in tput if p.startswith("leantrain")):
            for other in [*peers, "dense"]:
                if other in tput and tput[other] > 0:
                    lines.append(f"- {mode}: {mine} / {other} tokens/s = {tput[mine] / tput[other]:.3f}")
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    header = ["mode", "x", "provider", "config", "metric", "p50", "p20", "p80"]
    body = []
    for r in rows:
        conf = ", ".join(f"{k}={v}" for k, v in r.config.items() if k in ("precision", "opt_proj_ms", "loss", "svd_s"))
        body.append([r.mode, r.x_value, r.provider, conf, f"{r.metric} ({r.unit})", r.p50, r.p20 or "", r.p80 or ""])
    return markdown_table(header, body)


def plot(rows: list[Row], out_dir: Path, name: str) -> None:
    speed = [r for r in rows if r.metric == "speed"]
    for mode in sorted({r.mode for r in speed}):
        chosen = [r for r in speed if r.mode == mode and r.config.get("precision", "fp32") in ("fp32",)]
        groups = sorted({str(r.x_value) for r in chosen})
        providers = sorted({r.provider for r in chosen})
        series = {
            p: [next((r.p50 for r in chosen if r.provider == p and str(r.x_value) == g), 0.0) for g in groups]
            for p in providers
        }
        if groups:
            safe = mode.replace(" ", "_").replace("+", "")
            bar_plot(out_dir / f"{name}_{safe}.png", f"OSFT {mode} (ms, lower is better)", groups, series, "ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU-friendly, < 60 s")
    parser.add_argument("--fsdp2", action="store_true", help="FSDP2 training step under torchrun (2 GPUs)")
    parser.add_argument("--profile", action="store_true", help="with --fsdp2: profile 3 steps of each variant")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: projection,linear,train")
    args = parser.parse_args()
    cfg = SMOKE if args.smoke else FULL
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("full size needs CUDA; use --smoke on CPU")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # tiny CPU shapes: threads only add contention
    mt, mt_reason = load_mini_trainer()
    peft, peft_reason = load_peft_osf()
    start = time.perf_counter()
    out_dir = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    if args.profile:
        PROFILE["dir"] = out_dir / "osft_fsdp2_profile"
    if args.fsdp2:
        rows = bench_fsdp2(cfg, mt, mt_reason)
        if dist.get_rank() == 0:
            text = f"{table(rows)}\n\n{summary(rows)}\n\nmini_trainer: {mt_reason}."
            write_results(f"{BENCH}_fsdp2", rows, text, out_dir)
            plot(rows, out_dir, f"{BENCH}_fsdp2")
            print(text)
        dist.destroy_process_group()
        return
    rows: list[Row] = []
    skip = set(args.skip.split(","))
    for section, fn in (("projection", bench_projection), ("linear", bench_linear)):
        if section not in skip:
            fn(cfg, rows, mt, peft)
            print(f"{section} done at {time.perf_counter() - start:.0f} s", flush=True)
    if "train" not in skip:
        bench_training(cfg, rows, mt, mt_reason)
    notes = (
        f"\n\n{summary(rows)}\n\nmini_trainer: {mt_reason}. PEFT OSF: {peft_reason}. "
        f"Wall time {time.perf_counter() - start:.0f} s."
    )
    write_results(BENCH, rows, table(rows) + notes, out_dir)
    plot(rows, out_dir, BENCH)
    print(table(rows) + notes)


if __name__ == "__main__":
    main()
