"""Issue #27 item 1: one Qwen3-30B-A3B-shaped MoE layer as transformers 4.x builds it (an ``experts`` ModuleList of
expert MLPs whose gate/up/down are per-expert ``bnb.nn.Linear4bit``, nf4, bf16 compute; E=128, top-8, H=2048, expert
I=768, norm_topk_prob), 4096 tokens, forward + backward into the hidden states: the stock per-expert loop vs
leantrain's grouped path (recompute on, the default, and off). Median CUDA-event ms (p20/p80), peak memory above the
weights, and the grouped path's relative error vs the loop. Target: grouped >= 25x the stock 4-bit loop.

``--lora``: PEFT LoRA r16 (alpha 32, bf16 adapters) on every expert's gate/up/down: PEFT's per-expert loop vs the
grouped base + split LoRA, and the same patched layer with the adapters disabled (the frozen grouped layer): split
LoRA's cost over the frozen layer (target <= 1.5x). Each step starts without adapter gradients, as a trainer step
does after ``zero_grad()``. Rows: ``moe4bit_modulelist_lora.{json,md}``.

The block is ``testkit.moe4bit_models.SparseMoeBlock4x`` (the 4.57 Qwen block, bit-equal to it on 4.57), so this runs
on any transformers version. Rows: ``${BENCH_RESULTS:-benchmarks/results}/moe4bit_modulelist.{json,md}``.

    PYTHONPATH=src:. python3 benchmarks/probe_moe4bit_modulelist.py          # CUDA, ~1-2 min on an H100
    PYTHONPATH=src:. python3 benchmarks/probe_moe4bit_modulelist.py --lora   # CUDA, LoRA on the experts, ~1 min
    PYTHONPATH=src:. python3 benchmarks/probe_moe4bit_modulelist.py --smoke [--lora] # tiny CPU run, seconds
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _harness import Row, markdown_table, peak_memory, time_fn, write_results  # noqa: E402

from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import SparseMoeBlock4x, load_in_4bit_like, patch_block_4x  # noqa: E402


FULL = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768, "tokens": 4096}  # Qwen3-30B-A3B, one layer
SMOKE = {"experts": 8, "top_k": 2, "hidden": 128, "inter": 64, "tokens": 64}


def build(shape: dict, device: torch.device, dtype: torch.dtype) -> SparseMoeBlock4x:
    """The layer as ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bf16,
    llm_int8_skip_modules=["gate"])`` loads it: experts in 4-bit on the device, the router in bf16."""
    torch.manual_seed(0)
    with torch.device("meta"):
        block = SparseMoeBlock4x(shape["hidden"], shape["inter"], shape["experts"], shape["top_k"], True)
    block = block.to_empty(device=device).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    load_in_4bit_like(block, skip=("gate",), compute_dtype=dtype, quant_type="nf4")
    return block.train()


def with_lora(block: torch.nn.Module, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """PEFT LoRA r16 (random B, so the adapters contribute) on every expert projection, adapters in the compute
    dtype (PEFT leaves them fp32 next to 4-bit weights; fp32 grouped GEMMs take torch's per-group path on CUDA):
    both providers run the same bf16 adapters. Returns the adapters' parameters."""
    import peft

    config = peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(1)
    peft.inject_adapter_in_model(config, block)
    params = [p for n, p in block.named_parameters() if "lora_" in n]
    for param in params:
        param.data = param.data.to(dtype)
        param.requires_grad_(True)
    return params


def adapters_enabled(block: torch.nn.Module, enabled: bool) -> None:
    for module in block.modules():
        if hasattr(module, "lora_A") and hasattr(module, "enable_adapters"):
            module.enable_adapters(enabled)


def step_fn(block: torch.nn.Module, xs: list[torch.Tensor], grad: torch.Tensor, params=()):
    """Forward + backward into the hidden states (experts frozen; the router's weight grad is computed too; the
    adapters' too, each step starting without them)."""

    def step(i: int) -> torch.Tensor:
        for param in params:
            param.grad = None
        x = xs[i % len(xs)].detach().requires_grad_()
        out, _ = block(x)
        out.backward(grad)
        block.gate.weight.grad = None
        return x.grad

    return step


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script, seconds)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--lora", action="store_true", help="LoRA r16 on every expert projection")
    args = parser.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    shape = SMOKE if smoke else FULL
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.bfloat16
    reps = args.reps or (2 if smoke else 10)
    block = build(shape, device, dtype)
    params = with_lora(block, dtype) if args.lora else []
    name = "moe4bit_modulelist_lora" if args.lora else "moe4bit_modulelist"
    gen = torch.Generator(device=device).manual_seed(1)
    xs = [
        torch.randn(1, shape["tokens"], shape["hidden"], device=device, dtype=dtype, generator=gen) for _ in range(2)
    ]
    grad = torch.randn(1, shape["tokens"], shape["hidden"], device=device, dtype=dtype, generator=gen)

    results, outputs = {}, {}
    providers = [("stock", None, True), ("leantrain", True, True)]
    providers += [("leantrain_frozen", True, False)] if args.lora else [("leantrain_no_recompute", False, True)]
    for provider, recompute, enabled in providers:
        undo = Undo()
        adapters_enabled(block, enabled)
        if recompute is not None:
            patch_block_4x(block, undo, recompute=recompute)  # strict: a fallback would time the loop
        step = step_fn(block, xs, grad, params)
        outputs[provider] = step(0).float()
        timing = time_fn(step, warmup=1 if smoke else 3, reps=reps)
        memory = peak_memory(lambda step=step: step(0))
        results[provider] = (timing, memory)
        undo()
        print(f"{provider}: {timing.p50:.2f} ms (p20 {timing.p20:.2f}, p80 {timing.p80:.2f}), peak {memory:.2f} GiB")

    stock_ms = results["stock"][0].p50
    config = {**shape, "dtype": "bf16", "quant_type": "nf4", "compute_dtype": "bf16", "norm_topk_prob": True}
    config |= {"lora_rank": 16, "lora_alpha": 32} if args.lora else {}
    rows, table = [], []
    for provider, (timing, memory) in results.items():
        err = float("nan")  # the frozen layer (adapters disabled) computes another function
        if provider != "leantrain_frozen":
            err = ((outputs[provider] - outputs["stock"]).norm() / outputs["stock"].norm()).item()
        cfg = {**config, "speedup_vs_stock": stock_ms / timing.p50, "input_grad_rel_err_vs_stock": err}
        rows.append(
            Row(name, provider, "full", "speed", "ms", "tokens", shape["tokens"], timing.p50, timing.p20, timing.p80,
                cfg)
        )  # fmt: skip
        rows.append(Row(name, provider, "full", "memory", "GiB", "tokens", shape["tokens"], memory, config=config))
        table.append((provider, timing.p50, timing.p20, timing.p80, stock_ms / timing.p50, memory, err))
    header = ("provider", "fwd+bwd ms (p50)", "p20", "p80", "speedup vs stock", "peak GiB", "dX rel err vs stock")
    lines = [markdown_table(header, table), ""]
    speedup = stock_ms / results["leantrain"][0].p50
    if args.lora:
        ratio = results["leantrain"][0].p50 / results["leantrain_frozen"][0].p50
        lines.append(
            f"Split LoRA on the 4.x block: {ratio:.2f}x the frozen grouped layer (target <= 1.5x: "
            f"{'met' if ratio <= 1.5 else 'NOT met'}); {speedup:.1f}x PEFT's per-expert loop."
        )
    elif not smoke:
        lines.append(
            f"grouped {speedup:.1f}x the stock 4-bit loop (target >= 25x: {'met' if speedup >= 25 else 'NOT met'})"
        )
    out = write_results(name, rows, "\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}/{name}.json")
    return out


if __name__ == "__main__":
    main()
