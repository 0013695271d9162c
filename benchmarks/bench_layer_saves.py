"""What one LoRA decoder layer keeps for its backward, and what its forward + backward costs, for each way of running
it: stock (PEFT on transformers' eager layer), compiled with PEFT's own LoRA forward (``compiled_peft``), compiled as
``compile_layers`` compiles it by default (``compiled``: the LoRA scaling on the rank-r side, each wide LoRA
projection as one GEMM), that with the gated LoRA MLP as one function whose backward runs in row chunks
(``compiled_chunked_mlp``: ``compile_layers_mlp_chunks``, ``--mlp-chunks``, 4 by default: what a run with
``offload_checkpoints=True`` gets), that with PEFT's two GEMMs per LoRA projection
(``compiled_two_gemm``: a full-width adapter product beside the base one), and with
``compile_layers_recompute="elementwise"`` (the partition recomputes norms, activations and casts in the
backward).

Under activation checkpointing the backward of each layer first recomputes its forward, so what the layer saves is
the per-layer part of the training step's peak memory. Counted exactly with ``saved_tensors_hooks`` (every saved
tensor but the parameters and the layer's input, each storage once), on any device; on CUDA also the peak memory of
one forward + backward above what was allocated before (and of the forward alone: a checkpointed layer's first
pass), and its time (median of ``--reps``).

Shapes (random-init, bf16, LoRA r16 alpha 32 on the 7 projections, fp32 adapters as PEFT makes them, autocast
bf16): ``llama-3.2-1b`` and ``qwen2.5-1.5b`` layers. Rows go to ``layer_saves.{json,md}`` in $BENCH_RESULTS (else
benchmarks/results/); the saved bytes are also given per 8192 tokens (the token-sized tensors scaled, the rest as is).
    python benchmarks/bench_layer_saves.py                    # CPU: 128 tokens, inductor (minutes: bf16 on CPU)
    python benchmarks/bench_layer_saves.py --tokens 8192      # on the GPU machine (seconds)
    python benchmarks/bench_layer_saves.py --smoke            # tiny layer, aot_eager (tests)
    python benchmarks/bench_layer_saves.py --quant            # QLoRA layers (nf4): layer_saves_qlora.{json,md,png}
On CUDA, ``--trace`` also records the allocator's history over one forward + backward and lists what is alive at its
peak (memory_peak.py; a compiled buffer is named by its line of generated code), and ``--config`` sets torch compile
settings for the compiled variants (``inductor.NAME=VALUE`` or ``functorch.NAME=VALUE``, Python literals), e.g.
    python benchmarks/bench_layer_saves.py --trace --variants compiled --config inductor.memory_planning=True
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _harness import RESULTS, Row, bar_plot, markdown_table, write_results
from memory_peak import frame_label, group_blocks, live_at_peak


NAME = "layer_saves"
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, family="llama"),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                         head_dim=128, family="qwen2"),
    "tiny": dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 family="llama"),
}  # fmt: skip
VARIANTS = ("stock", "compiled_peft", "compiled_two_gemm", "compiled", "compiled_chunked_mlp", "compiled_elementwise")
GIB = 1024**3
MLP_CHUNKS = 4  # --mlp-chunks: compile_layers_mlp_chunks of the compiled_chunked_mlp variant


def build_layer(shape: str, device: torch.device, quant: bool = False) -> tuple[torch.nn.Module, torch.nn.Module, int]:
    """A PEFT-wrapped decoder layer of ``shape`` on ``device`` in bf16 (``quant``: its linears in bitsandbytes nf4,
    double-quantized, bf16 compute, as QLoRA loads them), its model's rotary embedding, the width."""
    import peft
    import transformers

    fields = dict(SHAPES[shape])
    family = fields.pop("family")
    config_class = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    config = config_class(num_hidden_layers=1, vocab_size=128, **fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device, torch.bfloat16)
    if quant:
        from testkit.moe4bit_models import load_in_4bit_like

        load_in_4bit_like(model, compute_dtype=torch.bfloat16, double_quant=True)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    model = peft.get_peft_model(model, lora).base_model.model
    return model.model.layers[0], model.model.rotary_emb, config.hidden_size


def layer_call(layer: torch.nn.Module, variant: str, backend: str) -> Callable[..., Any]:
    """The layer's forward as the variant runs it (the compiled ones as compile_layers builds its backend)."""
    if variant == "stock":
        return layer.forward
    from leantrain.compile_layers.ops import gated_lora_mlp, is_gated_lora_mlp, recomputing_elementwise, scaling_folds
    from leantrain.compile_layers.patch import RANK_SIDE

    if variant != "compiled_peft":  # as compile_layers binds it: the LoRA scaling on the rank-r side
        for module in layer.modules():
            forward = RANK_SIDE.get((type(module).__module__, type(module).__name__))
            if forward is not None and variant == "compiled_two_gemm":
                forward = two_gemm_forward
            if forward is not None and scaling_folds(module, "default"):
                module.forward = types.MethodType(forward, module)
    if variant == "compiled_chunked_mlp" and is_gated_lora_mlp(layer.mlp):
        layer.mlp.forward = types.MethodType(lambda mlp, x: gated_lora_mlp(mlp, x, MLP_CHUNKS), layer.mlp)
    compile_backend = torch._dynamo.lookup_backend(backend)
    if variant == "compiled_elementwise":
        compile_backend = recomputing_elementwise(compile_backend)
    return torch.compile(layer.forward, backend=compile_backend)


def two_gemm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """compile_layers' rank-side LoRA forward with PEFT's two GEMMs (base and adapter products, then their sum) on
    every projection."""
    from leantrain.compile_layers.ops import lora_two_gemms

    if type(self).__name__ == "Linear4bit":  # QLoRA, in autocast: the 4-bit GEMM, the adapter's, their sum
        adapter = self.lora_B["default"](self.lora_A["default"](x) * self.scaling["default"])
        return self.base_layer(x).clone() + adapter
    return lora_two_gemms(self, x, "default")


def measure(  # noqa: PLR0913 (the benchmark's switches)
    shape: str, variant: str, tokens: int, backend: str, reps: int, trace: bool = False, quant: bool = False,
    profile: bool = False,
) -> dict[str, Any]:  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.reset()
    layer, rotary, hidden = build_layer(shape, device, quant)
    x = torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rotary(x, torch.arange(tokens, device=device)[None])
    forward = layer_call(layer, variant, backend)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = (t.untyped_storage().nbytes(), tokens in t.shape)
        return t

    def step(record: bool = False) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if record else contextlib.nullcontext()
        with hooks, torch.autocast(device.type, torch.bfloat16):
            out = forward(x, position_embeddings=(cos, sin), attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    start = time.perf_counter()
    step()  # compiles
    first_s = time.perf_counter() - start
    step(record=True)
    scale = 8192 / tokens
    per_8192 = sum(b * (scale if per_token else 1) for b, per_token in saved.values()) / GIB
    result = {"saved_gib": sum(b for b, _ in saved.values()) / GIB, "tensors": len(saved), "first_s": first_s,
              "saved_gib_8192": per_8192}  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        result["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
        result["forward_peak_gib"] = forward_peak(forward, x, cos, sin, base)
        times = []
        for _ in range(reps):
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
            step()
            end_event.record()
            end_event.synchronize()
            times.append(start_event.elapsed_time(end_event))
        result["ms"] = statistics.median(times)
        result["host_ms"] = host_ms(step, reps)
        if profile:
            result["profile"] = profiled(step)
        if trace:
            result["trace"] = traced(step)
    return result


def forward_peak(
    forward: Callable[..., Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, base: int
) -> float:
    """The peak of one forward with autograd recording (a checkpointed layer's first pass under non-reentrant
    checkpointing: its saves are made, then dropped), GiB above ``base``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", torch.bfloat16):
        out = forward(x, position_embeddings=(cos, sin), attention_mask=None)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    del out
    return peak


def host_ms(step: Callable[[], None], reps: int) -> float:
    """The host's time to issue one forward + backward from an idle GPU (median of ``reps``): where it nears the
    GPU's time (``ms``), a training step on this layer is bound by Python and launches, not by the GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    torch.cuda.synchronize()
    return statistics.median(times)


def profiled(step: Callable[[], None], top: int = 25) -> str:
    """torch.profiler's table of the ops with the most host time over three steps."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def traced(step: Callable[[], None]) -> dict[str, Any]:
    """What is alive at the peak of one ``step()`` (GiB above what was allocated before it), grouped by the code that
    allocated it."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = live_at_peak(events)
    return {"peak_gib": round(peak / GIB, 4), "before_gib": round(start / GIB, 4),
            "groups": group_blocks(blocks, top=30, label=frame_label)}  # fmt: skip


def set_compile_config(items: list[str]) -> dict[str, Any]:
    """``inductor.NAME=VALUE`` / ``functorch.NAME=VALUE`` items set on torch's config modules (values as literals)."""
    import ast

    modules = {"inductor": torch._inductor.config, "functorch": torch._functorch.config}
    done: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        owner, _, name = key.partition(".")
        if owner not in modules or not name or not hasattr(modules[owner], name) or not value:
            raise SystemExit(f"--config takes inductor.NAME=VALUE or functorch.NAME=VALUE (a setting torch has), "
                             f"got {item!r}")  # fmt: skip
        setattr(modules[owner], name, ast.literal_eval(value))
        done[key] = getattr(modules[owner], name)
    return done


def rows_of(shape: str, variant: str, tokens: int, backend: str, result: dict[str, Any]) -> list[Row]:
    config = {"tokens": tokens, "backend": backend if variant != "stock" else "eager", "first_s": result["first_s"],
              "tensors": result["tensors"], "saved_gib_at_tokens": result["saved_gib"],
              "settings": result.get("settings", {}), "trace": result.get("trace"),
              "host_ms": result.get("host_ms"), "profile": result.get("profile")}  # fmt: skip
    rows = [Row(NAME, variant, "saved", "memory", "GiB", "shape", shape, result["saved_gib_8192"], config=config)]
    if "peak_gib" in result:
        peak, ms = result["peak_gib"], result["ms"]
        rows.append(Row(NAME, variant, "fwd+bwd peak", "memory", "GiB", "shape", shape, peak, config=config))
        forward = result["forward_peak_gib"]
        rows.append(Row(NAME, variant, "fwd peak", "memory", "GiB", "shape", shape, forward, config=config))
        rows.append(Row(NAME, variant, "fwd+bwd", "speed", "ms", "shape", shape, ms, config=config))
    return rows


def table(rows: list[Row]) -> str:
    by = {(r.x_value, r.provider, r.mode): r for r in rows}
    lines = []
    for shape in dict.fromkeys(r.x_value for r in rows):
        stock = by.get((shape, "stock", "saved"))
        for variant in VARIANTS:
            saved = by.get((shape, variant, "saved"))
            if saved is None:
                continue
            peak, ms = by.get((shape, variant, "fwd+bwd peak")), by.get((shape, variant, "fwd+bwd"))
            forward = by.get((shape, variant, "fwd peak"))
            lines.append([shape, variant, f"{saved.p50:.3f}", f"{saved.p50 / stock.p50:.2f}x" if stock else "-",
                          f"{forward.p50:.3f}" if forward else "-", f"{peak.p50:.3f}" if peak else "-",
                          f"{ms.p50:.2f}" if ms else "-", host_column(ms)])  # fmt: skip
    header = ["layer", "variant", "saved for backward, GiB per 8192 tokens", "vs stock", "fwd peak GiB",
              "fwd+bwd peak GiB", "ms", "host ms to issue"]  # fmt: skip
    return markdown_table(header, lines)


def host_column(row: Row | None) -> str:
    host = row.config.get("host_ms") if row else None
    return f"{host:.2f}" if host is not None else "-"


def plot(rows: list[Row], path: Path) -> None:
    """Bars per (layer, variant): what it saves for the backward and its forward + backward peak (CUDA rows)."""
    by = {(r.x_value, r.provider, r.mode): r.p50 for r in rows}
    keys = [
        (shape, v) for shape in dict.fromkeys(r.x_value for r in rows) for v in VARIANTS if (shape, v, "saved") in by
    ]
    if not keys or not all((shape, v, "fwd+bwd peak") in by for shape, v in keys):
        return
    series = {"saved for backward": [by[(s, v, "saved")] for s, v in keys],
              "forward + backward peak": [by[(s, v, "fwd+bwd peak")] for s, v in keys]}  # fmt: skip
    groups = [f"{s}\n{v}" for s, v in keys]
    bar_plot(path, "One LoRA decoder layer, 8192 tokens (GiB)", groups, series, "GiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama-3.2-1b,qwen2.5-1.5b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tokens", type=int, default=0, help="sequence length (default: 8192 on CUDA, 128 on CPU)")
    parser.add_argument("--backend", default="inductor", help="compile backend of the compiled variants")
    parser.add_argument("--reps", type=int, default=10, help="timed forward + backward calls (CUDA)")
    parser.add_argument("--smoke", action="store_true", help="the tiny layer, 32 tokens, aot_eager (tests)")
    parser.add_argument("--trace", action="store_true", help="CUDA: what is alive at one forward + backward's peak")
    parser.add_argument("--quant", action="store_true", help="the layers' linears in nf4 (QLoRA; needs bitsandbytes)")
    parser.add_argument("--config", nargs="*", default=[], help="inductor.NAME=VALUE / functorch.NAME=VALUE")
    parser.add_argument("--profile", action="store_true", help="CUDA: print the ops with the most host time")
    parser.add_argument("--mlp-chunks", type=int, default=MLP_CHUNKS, help="compiled_chunked_mlp's row chunks")
    args = parser.parse_args(argv)
    globals()["MLP_CHUNKS"] = args.mlp_chunks
    settings = set_compile_config(args.config)
    shapes = ["tiny"] if args.smoke else args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES] + [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown {unknown}: shapes {list(SHAPES)}, variants {list(VARIANTS)}")
    tokens = 32 if args.smoke else args.tokens or (8192 if torch.cuda.is_available() else 128)
    backend = "aot_eager" if args.smoke else args.backend
    out = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    rows: list[Row] = []
    for shape in shapes:
        for variant in args.variants.split(","):
            result = measure(shape, variant, tokens, backend, args.reps, args.trace, args.quant, args.profile)
            result["settings"] = settings if variant != "stock" else {}
            print(f"{shape} {variant}: saved {result['saved_gib_8192']:.3f} GiB per 8192 tokens "
                  f"({result['tensors']} tensors)" + (f", peak {result['peak_gib']:.3f} GiB, {result['ms']:.2f} ms"
                                                       if "ms" in result else ""), flush=True)  # fmt: skip
            if "host_ms" in result:
                print(f"    host {result['host_ms']:.2f} ms to issue it", flush=True)
            if "profile" in result:
                print(result["profile"], flush=True)
            for group in result.get("trace", {}).get("groups", []):
                print(f"    {group['gib']:.4f} GiB {group['blocks']:4d}  {group['where']}")
            rows += rows_of(f"{shape}-qlora" if args.quant else shape, variant, tokens, backend, result)
    name = (f"{NAME}_smoke" if args.smoke else NAME) + ("_qlora" if args.quant else "")
    write_results(name, rows, table(rows), out)
    plot(rows, out / f"{name}.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
