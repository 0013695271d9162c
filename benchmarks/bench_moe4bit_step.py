"""Whole QLoRA training step with LoRA on the 4-bit experts: one Qwen3-30B-A3B decoder layer (H=2048, 32 q / 4 kv
heads, head_dim 128, E=128, top-8, norm_topk_prob, expert intermediate 768), vocab 16384 untied, random seeded
weights saved and reloaded with ``from_pretrained``; 1x4096 tokens, ``labels=input_ids``, bf16, no gradient
checkpointing; LoRA r=16, alpha 32; forward + backward + SGD step; median of 10 after 3 warm-ups; peak =
``max_memory_allocated`` over the timed steps, weights included.

Providers, in one run (transformers 5.x, 3-D experts):
- ``stock``: ``BitsAndBytesConfig`` nf4 (attention linears 4-bit, 3-D experts stay bf16), LoRA on q/k/v/o and on
  both expert stacks through PEFT ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``;
- ``leantrain``: the same attention; experts quantized by ``leantrain.quantize_experts_4bit``; LoRA on q/k/v/o and
  both expert stacks (``target_parameters=leantrain.expert_lora_targets(model)``); ``leantrain.patch_trainer`` on a
  minimal ``Trainer`` (moe4bit only; the report is printed and recorded);
- ``leantrain_attn_only``: as ``leantrain`` with LoRA on q/k/v/o only.

``--transformers4`` (needs transformers 4.x: each expert a ``Qwen3MoeMLP`` whose projections ``BitsAndBytesConfig``
makes ``Linear4bit``, router included; writes ``moe4bit_step_4x.*``): LoRA r16 through PEFT
``target_modules=[q, k, v, o, gate_proj, up_proj, down_proj]`` (every expert's three projections), forward under
bf16 autocast as ``Trainer(bf16=True)`` runs it:
- ``stock``: PEFT's per-expert loop; ``leantrain``: the same model patched; ``leantrain_attn_only``: LoRA on
  q/k/v/o only, patched. Each provider also records its first step: seconds from ``patch_trainer`` (stock: from the
  model being ready) to the end of the first training step.

    python benchmarks/bench_moe4bit_step.py                   # CUDA (about 2 minutes on an H100)
    python benchmarks/bench_moe4bit_step.py --transformers4   # CUDA, transformers 4.57 (about 2 minutes)
    python benchmarks/bench_moe4bit_step.py --smoke [--transformers4]   # CPU, tiny shapes (seconds)

Writes ``moe4bit_step[_4x].json`` / ``.md`` into ``$BENCH_RESULTS`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import tempfile
import time
from pathlib import Path

import torch
import transformers
from _harness import RESULTS, Row, markdown_table, time_fn, write_results  # noqa: E402

import leantrain  # noqa: E402
from testkit.optimizations import only  # noqa: E402


NAME = "moe4bit_step"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
STOCK_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
EXPERT_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]  # transformers 4.x expert MLPs
STOCK_MS, STOCK_GIB = 21.7, 4.20  # notes/moe4bit.md section 7 (H100, transformers 5.17, peft 0.21.0)


@dataclasses.dataclass
class Setup:
    device: str
    tokens: int
    warmup: int
    reps: int
    config: dict
    transformers4: bool = False  # 4.x per-expert MLP blocks, LoRA through target_modules on every expert projection

    @property
    def name(self) -> str:
        return f"{NAME}_4x" if self.transformers4 else NAME


FULL = Setup(
    "cuda",
    4096,
    3,
    10,
    dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, moe_intermediate_size=768, intermediate_size=6144,
        vocab_size=16384, max_position_embeddings=8192,
    ),
)  # fmt: skip
SMOKE = Setup(
    "cpu",
    64,
    1,
    2,
    dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=64, intermediate_size=256, vocab_size=512,
        max_position_embeddings=256,
    ),
)  # fmt: skip


def save_random_model(s: Setup, path: str) -> None:
    config = transformers.Qwen3MoeConfig(num_hidden_layers=1, tie_word_embeddings=False, **s.config)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def load_4bit(s: Setup, path: str) -> transformers.PreTrainedModel:
    """Every nn.Linear but lm_head in nf4 as ``BitsAndBytesConfig`` makes it: attention; on 5.x the 3-D experts stay
    bf16, on 4.x every expert projection (and the router) is a ``Linear4bit``."""
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=torch.bfloat16, device_map={"": s.device}
    )
    return model.train()


def build(provider: str, s: Setup, path: str, tmp: str):
    """(model, report text) for one provider, LoRA attached and, for leantrain, patched."""
    import peft

    model = load_4bit(s, path)
    lora = dict(r=16, lora_alpha=32, target_modules=ATTENTION)
    if s.transformers4:
        return build_4x(provider, model, lora, tmp, s)
    if provider == "stock":
        model = peft.get_peft_model(model, peft.LoraConfig(target_parameters=STOCK_STACKS, **lora))
        return model, "stock: no patch", None
    report = leantrain.quantize_experts_4bit(model)
    if provider == "leantrain":
        lora["target_parameters"] = leantrain.expert_lora_targets(model)
    model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    return model, f"{report}\n{patch(trainer_for(model, tmp, s))}", None


def trainer_for(model, tmp: str, s: Setup) -> transformers.Trainer:
    """A minimal ``Trainer`` around the model, as the user's script has built it before calling leantrain."""
    args = transformers.TrainingArguments(output_dir=tmp, report_to=[], use_cpu=s.device == "cpu", save_strategy="no")
    return transformers.Trainer(model=model, args=args)


def patch(trainer: transformers.Trainer) -> str:
    """``leantrain.patch_trainer`` (moe4bit only); a decline stops the run (it would time the stock path under
    leantrain's name)."""
    report = leantrain.patch_trainer(trainer, **only("moe4bit"))
    if report["moe4bit"].status.value != "applied":
        raise SystemExit(f"moe4bit did not apply: {report['moe4bit'].reasons}")
    return str(report)


def build_4x(provider: str, model, lora: dict, tmp: str, s: Setup):
    """transformers 4.x: LoRA on attention and every expert projection (or attention only), PEFT's lora.Linear4bit
    on each; leantrain patches the minimal Trainer. The clock for the first step starts just before
    ``patch_trainer`` (stock: once the model is ready), after the Trainer exists as in a user's script."""
    import peft

    if provider != "leantrain_attn_only":
        lora["target_modules"] = ATTENTION + EXPERT_PROJECTIONS
    model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    trainer = trainer_for(model, tmp, s)
    started = time.perf_counter()
    if provider == "stock":
        return model, "stock: no patch", started
    return model, patch(trainer), started


def bench(provider: str, s: Setup, path: str, rows: list[Row]) -> tuple[float, float, str, float | None]:
    """(median ms, peak GiB, report text, seconds to the end of the first step or None) of one provider."""
    with tempfile.TemporaryDirectory() as tmp:
        model, text, started = build(provider, s, path, tmp)
    print(f"[{provider}] {text}", flush=True)
    ids = torch.randint(3, s.config["vocab_size"], (1, s.tokens), device=s.device, generator=None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-5)

    # --transformers4: the forward under bf16 autocast, as Trainer(bf16=True) runs it: PEFT's fp32 adapters on
    # Linear4bit compute in bf16 there (without autocast they compute in fp32, which CUDA's grouped GEMM serves with a
    # per-expert loop; the report says so)
    autocast = torch.autocast(s.device, dtype=torch.bfloat16, enabled=s.transformers4)

    def step(_i: int = 0) -> None:
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    config = {**s.config, "tokens": s.tokens, "lora_rank": 16, "lora_alpha": 32, "autocast_bf16": s.transformers4}
    config |= {"trainable": sum(p.numel() for p in params), "transformers4": s.transformers4}
    first = None
    if started is not None:  # the first training step after patch_trainer (stock: after the model is ready)
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        first = time.perf_counter() - started
        rows.append(Row(s.name, provider, "first step", "time", "s", "tokens", s.tokens, first, config=config))
        print(f"{provider:<20} first step ends {first:.1f} s after patch_trainer", flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time_fn(step, warmup=s.warmup, reps=s.reps)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    rows.append(Row.timing(s.name, provider, "train step", "tokens", s.tokens, t, **config))
    rows.append(Row(s.name, provider, "train step", "memory", "GiB", "tokens", s.tokens, peak, config=config))
    print(f"{provider:<20} {t.p50:9.2f} ms  peak {peak:.3f} GiB", flush=True)
    return t.p50, peak, text, first


def release() -> None:
    """Free the previous provider's model before the next one loads (its peak must not count)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def summary(results: dict[str, tuple[float, float, str, float | None]], transformers4: bool) -> str:
    stock_ms, stock_gib = results["stock"][:2]
    table = [
        [name, ms, gib, ms / stock_ms, gib / stock_gib, "-" if first is None else first]
        for name, (ms, gib, _, first) in results.items()
    ]
    header = ["provider", "ms", "peak GiB", "time / stock", "peak / stock", "first step s"]
    lines = [markdown_table(header, table), ""]
    ms, gib, text, first = results["leantrain"]
    if transformers4:
        lines.append(
            f"leantrain (LoRA on attention + every expert projection, transformers 4.x blocks): {ms:.1f} ms (target "
            f"<= 30 ms: {'met' if ms <= 30 else 'NOT met'}), {stock_ms / ms:.1f}x the stock per-expert loop (target "
            f">= 18x: {'met' if stock_ms >= 18 * ms else 'NOT met'}), peak {gib:.2f} vs {stock_gib:.2f} GiB (target "
            f"<= stock: {'met' if gib <= stock_gib else 'NOT met'}), first step {first:.1f} s after patch_trainer "
            f"(target <= 30 s: {'met' if first <= 30 else 'NOT met'})."
        )
    else:
        lines.append(
            f"leantrain (LoRA on attention + experts): {ms / stock_ms:.2f}x stock time (target <= 0.80x: "
            f"{'met' if ms <= 0.8 * stock_ms else 'NOT met'}), {gib / stock_gib:.2f}x stock peak (target <= 0.45x: "
            f"{'met' if gib <= 0.45 * stock_gib else 'NOT met'}). Earlier stock record: {STOCK_MS} ms / "
            f"{STOCK_GIB} GiB."
        )
    lines += ["", "What applied (leantrain):", "", "```", text, "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--providers", default="stock,leantrain,leantrain_attn_only")
    parser.add_argument(
        "--transformers4", action="store_true", help="transformers 4.x per-expert MLP blocks, LoRA on every expert"
    )
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke or not torch.cuda.is_available() else FULL
    s = dataclasses.replace(s, transformers4=args.transformers4)
    major = int(transformers.__version__.split(".")[0])
    if args.transformers4 != (major < 5):
        raise SystemExit(
            f"transformers {transformers.__version__}: --transformers4 needs transformers 4.x, the default mode 5.x"
        )
    if s.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows: list[Row] = []
    results = {}
    with tempfile.TemporaryDirectory() as path:
        save_random_model(s, path)
        for provider in args.providers.split(","):
            results[provider] = bench(provider, s, path, rows)
            release()
    table = summary(results, s.transformers4) if {"stock", "leantrain"} <= results.keys() else ""
    out_dir = write_results(s.name, rows, table, Path(os.environ.get("BENCH_RESULTS", RESULTS)))
    print(table)
    print(f"wrote {out_dir / s.name}.json/.md")
    return out_dir


if __name__ == "__main__":
    main()
