"""Grouped 4-bit MoE experts vs the per-expert bitsandbytes loop (and the bf16 grouped floor).

Layer benchmark at gpt-oss-20b expert shapes (E=32, top-4, H=I=2880; bf16; fwd+bwd into hidden states and router
weights) at 512 / 4096 / 16384 tokens:
- ``bnb loop``: per-expert ``bnb.nn.Linear4bit`` lists with the stock per-expert loop (community 4-bit gpt-oss);
- ``leantrain grouped``: the same modules patched (one dequantize per stack + grouped GEMMs), recompute on / off;
- ``leantrain grouped (stacked)``: stock 3-D experts after ``leantrain.quantize_experts_4bit``;
- ``transformers grouped_mm (4-bit stacked)``: the stock path of that module (dequantize-on-access parametrization);
- ``grouped floor (pre-dequantized)``: leantrain's grouped path on pre-dequantized bf16 stacks (no dequantize);
- ``transformers grouped_mm (dense weights)``: HF's grouped experts on bf16 3-D weights (peer).
- LoRA on every expert (r=16, alpha 32, bf16 adapters): ``PEFT LoRA loop`` (PEFT LoRA layers on each expert
  ``Linear4bit``, the stock per-expert loop) vs ``leantrain grouped + split LoRA`` (the same module patched: base
  and adapters as grouped GEMMs), and ``leantrain grouped + split LoRA (stacked)`` (``target_parameters`` LoRA on
  ``quantize_experts_4bit`` stacks).
Plus peak memory per provider and a whole small gpt-oss-shaped model training step (loop vs grouped).

``--shape`` picks the expert shapes: ``gpt-oss-20b`` (default; E=32, top-4, H=I=2880), ``qwen3-30b-a3b`` (E=128,
top-8, H=2048, I=768) or ``deepseek-v2-lite`` (DeepSeek-V2-Lite-like routed experts: E=64, top-6, H=2048, I=1408;
SiLU experts without the shared expert). ``--lora-only`` times only the loop, grouped and LoRA providers.

    python benchmarks/bench_moe4bit.py            # CUDA, full size (< 4 minutes on an H100)
    python benchmarks/bench_moe4bit.py --shape qwen3-30b-a3b --lora-only --no-model
    python benchmarks/bench_moe4bit.py --smoke    # CPU, tiny shapes (< 60 s)
    python benchmarks/bench_moe4bit.py --smoke --profile   # + op counts / non-GEMM CPU time per provider

Writes ``moe4bit.json`` / ``.md`` / ``.png`` (``moe4bit_<shape>.*`` for the other shapes) into ``$BENCH_RESULTS``
or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import tempfile
from pathlib import Path

import torch
import transformers
from _harness import RESULTS, Row, bar_plot, markdown_table, peak_memory, time_fn, write_results  # noqa: E402

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model  # noqa: E402
from leantrain.moe4bit import _adapters, ops  # noqa: E402
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.moe4bit.registry import LAYOUTS, build_plan  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import convert_model_to_linear4bit_experts, linear4bit_experts_from  # noqa: E402
from testkit.optimizations import only  # noqa: E402


NAME = "moe4bit"
LOOP, GROUPED, FLOOR = "bnb loop", "leantrain grouped", "grouped floor (pre-dequantized)"
LORA_LOOP, LORA_GROUPED = "PEFT LoRA loop (per-expert)", "leantrain grouped + split LoRA"
LORA_STACKED = f"{LORA_GROUPED} (stacked)"
DENSE_ROUTING = (LOOP, GROUPED, LORA_LOOP, LORA_GROUPED)  # the community layout's router: dense [T, E]
LORA_RANK, LORA_ALPHA = 16, 32
# expert shapes: (experts, top_k, hidden, expert intermediate, family of the experts module)
SHAPES = {
    "gpt-oss-20b": (32, 4, 2880, 2880, "gpt_oss"),
    "qwen3-30b-a3b": (128, 8, 2048, 768, "qwen3_moe"),
    "deepseek-v2-lite": (64, 6, 2048, 1408, "qwen3_moe"),  # routed experts only; SiLU gated MLPs like Qwen3's
}


@dataclasses.dataclass
class Setup:
    device: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: tuple[int, ...]
    warmup: int
    reps: int
    model: dict  # whole-model step: tiny_config overrides + batch shape
    dtype: torch.dtype = torch.bfloat16
    family: str = "gpt_oss"
    shape: str = "gpt-oss-20b"


FULL = Setup(
    "cuda",
    32,
    4,
    2880,
    2880,
    (512, 4096, 16384),
    3,
    10,
    {"hidden": 1024, "inter": 1024, "layers": 4, "vocab": 8192, "batch": 4, "seq": 1024},
)
SMOKE = Setup(  # fp32: CPUs without bf16 matmul units run bf16 slowly, and the smoke run only checks the script
    "cpu",
    8,
    4,
    128,
    128,
    (32, 128),
    1,
    2,
    {"hidden": 128, "inter": 128, "layers": 2, "vocab": 512, "batch": 2, "seq": 32},
    torch.float32,
)


class Dense:
    """A 'stack' that is already dequantized: the grouped path minus the dequantize (the floor)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight


def with_shape(s: Setup, shape: str) -> Setup:
    """``s`` at the named expert shapes (the smoke setup keeps its tiny sizes and takes only the family)."""
    experts, top_k, hidden, inter, family = SHAPES[shape]
    if s.device == "cpu":
        return dataclasses.replace(s, family=family, shape=shape)
    return dataclasses.replace(s, experts=experts, top_k=top_k, hidden=hidden, inter=inter, family=family, shape=shape)


def stock_experts(s: Setup) -> torch.nn.Module:
    """Stock transformers 3-D experts at the setup's shapes (gpt-oss, or Qwen3-MoE-style SiLU experts)."""
    if s.family == "gpt_oss":
        config = transformers.GptOssConfig(
            hidden_size=s.hidden, intermediate_size=s.inter, num_local_experts=s.experts, num_experts_per_tok=s.top_k
        )
        cls = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts
    else:
        config = transformers.Qwen3MoeConfig(
            hidden_size=s.hidden, moe_intermediate_size=s.inter, num_experts=s.experts, num_experts_per_tok=s.top_k
        )
        cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module.to(device=s.device, dtype=s.dtype).requires_grad_(False)


def _bf16_lora(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Adapters in the compute dtype (PEFT leaves them fp32 next to 4-bit weights; fp32 grouped GEMMs take torch's
    slow per-group path on CUDA): both LoRA providers run the same bf16 adapters."""
    for name, param in module.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(dtype)
            param.requires_grad_(True)


def lora_providers(s: Setup, stock: torch.nn.Module) -> dict[str, object]:
    """LoRA (r=16) on every expert: PEFT's per-expert loop vs the grouped path with split LoRA, per-expert lists and
    ``target_parameters`` on 4-bit stacks (random B, so the adapters contribute)."""
    import peft

    lists = linear4bit_experts_from(stock, quant_type="nf4", blocksize=64, compress_statistics=True)
    targets = [n for n, _ in lists.named_modules() if n.startswith(("gate_up_projs.", "down_projs."))]
    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(1)
    peft.inject_adapter_in_model(config, lists)
    _bf16_lora(lists, s.dtype)
    plan, _ = build_plan(Found("experts", lists, "linear4bit"), Undo().push, recompute=True)
    spec = LAYOUTS["linear4bit"].adapters(lists, _adapters.wrapped_map(lists))
    plan.adapters = _adapters.provider(spec, lists, Undo().push)

    stacked = copy.deepcopy(stock)
    leantrain.quantize_experts_4bit(stacked, compress_statistics=True)
    holder = torch.nn.Module()  # PEFT cannot wrap parameters of the module it is handed: give it a parent
    holder.experts = stacked
    config = peft.LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, target_parameters=_adapters.expert_lora_targets(holder),
        init_lora_weights=False,
    )  # fmt: skip
    peft.inject_adapter_in_model(config, holder)
    _bf16_lora(holder, s.dtype)
    stacked_plan, _ = build_plan(Found("experts", stacked, "stacked"), Undo().push, recompute=True)
    spec = LAYOUTS["stacked"].adapters(stacked, _adapters.wrapped_map(holder))
    stacked_plan.adapters = _adapters.provider(spec, stacked, Undo().push)

    def fresh_grads(fn, module):
        """A training micro-step as a trainer runs it after ``zero_grad()``: the adapters start without gradients
        (accumulating into existing ones would add one kernel per parameter, E of them per projection)."""
        params = [p for p in module.parameters() if p.requires_grad]

        def call(x, idx, w):
            for p in params:
                p.grad = None
            return fn(x, idx, w)

        return call

    def grouped(p):
        return lambda x, idx, w: ops.grouped_forward(p, x, idx, w)

    return {
        LORA_LOOP: fresh_grads(lists, lists),
        LORA_GROUPED: fresh_grads(grouped(plan), lists),
        LORA_STACKED: fresh_grads(grouped(stacked_plan), holder),
    }


def providers(s: Setup, lora_only: bool = False) -> dict[str, object]:
    """name -> callable(x, idx, weights) for every provider (built once; the loop module is timed unpatched)."""
    stock = stock_experts(s)
    loop = linear4bit_experts_from(stock, quant_type="nf4", blocksize=64, compress_statistics=True)
    # The grouped path consolidates the loop module's stacks in place (views): the loop keeps working unchanged.
    plan, _ = build_plan(Found("experts", loop, "linear4bit"), Undo().push, recompute=True)
    if lora_only:
        grouped_plan = plan
        return {
            LOOP: loop,
            GROUPED: lambda x, idx, w: ops.grouped_forward(grouped_plan, x, idx, w),
            **lora_providers(s, stock),
        }
    no_recompute = dataclasses.replace(plan, recompute=False)
    floor = dataclasses.replace(
        plan,
        gate_up=dataclasses.replace(plan.gate_up, stack=Dense(plan.gate_up.stack.dequantize(s.dtype))),
        down=dataclasses.replace(plan.down, stack=Dense(plan.down.stack.dequantize(s.dtype))),
    )
    stacked = copy.deepcopy(stock)
    leantrain.quantize_experts_4bit(stacked, compress_statistics=True)
    stacked_plan, _ = build_plan(Found("experts", stacked, "stacked"), Undo().push, recompute=True)

    def grouped(p):
        return lambda x, idx, w: ops.grouped_forward(p, x, idx, w)

    return {
        LOOP: loop,
        GROUPED: grouped(plan),
        f"{GROUPED} (no recompute)": grouped(no_recompute),
        f"{GROUPED} (stacked)": grouped(stacked_plan),
        "transformers grouped_mm (4-bit stacked)": stacked,
        FLOOR: grouped(floor),
        "transformers grouped_mm (dense weights)": stock,
        **lora_providers(s, stock),
    }


def layer_inputs(s: Setup, tokens: int, dense: bool):
    gen = torch.Generator(device=s.device).manual_seed(tokens)
    x = torch.randn(tokens, s.hidden, device=s.device, dtype=s.dtype, generator=gen).requires_grad_()
    logits = torch.randn(tokens, s.experts, device=s.device, dtype=s.dtype, generator=gen)
    top, idx = logits.topk(s.top_k, dim=1)
    weights = top.softmax(-1)
    if dense:  # the community layout's router returns dense [T, E] scores
        weights = torch.zeros_like(logits).scatter(1, idx, weights)
    grad = torch.randn(tokens, s.hidden, device=s.device, dtype=s.dtype, generator=gen)
    return x, idx, weights.requires_grad_(), grad


def bench_layers(s: Setup, rows: list[Row], lora_only: bool = False) -> dict[str, dict[int, float]]:
    fns = providers(s, lora_only)
    medians: dict[str, dict[int, float]] = {name: {} for name in fns}
    dtype = str(s.dtype).replace("torch.", "")
    config = {"experts": s.experts, "top_k": s.top_k, "hidden": s.hidden, "intermediate": s.inter, "dtype": dtype}
    config |= {"shape": s.shape, "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA}
    for tokens in s.tokens:
        for name, fn in fns.items():
            x, idx, weights, grad = layer_inputs(s, tokens, dense=name in DENSE_ROUTING)

            def step(_i: int = 0, fn=fn, x=x, idx=idx, weights=weights, grad=grad) -> None:
                x.grad = weights.grad = None
                fn(x, idx, weights).backward(grad)

            t = time_fn(step, warmup=s.warmup, reps=s.reps)
            medians[name][tokens] = t.p50
            rows.append(Row.timing(NAME, name, "fwd+bwd", "tokens", tokens, t, **config))
            mem = peak_memory(step)
            rows.append(Row(NAME, name, "fwd+bwd", "memory", "GiB", "tokens", tokens, mem, config=config))
            print(f"{tokens:>6} tokens  {name:<42} {t.p50:9.3f} ms  peak {mem:.3f} GiB", flush=True)
    return medians


def whole_model(s: Setup, layout_patch: bool, tmp: str):
    cfg = s.model
    model = tiny_model(
        "gpt_oss",
        seed=0,
        dtype=s.dtype,
        hidden=cfg["hidden"],
        layers=cfg["layers"],
        vocab_size=cfg["vocab"],
        intermediate_size=cfg["inter"],
        num_local_experts=s.experts,
        num_experts_per_tok=s.top_k,
    ).to(s.device)
    convert_model_to_linear4bit_experts(model)
    model.train()
    args = transformers.TrainingArguments(output_dir=tmp, report_to=[], use_cpu=s.device == "cpu", save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args)
    if layout_patch:
        report = leantrain.patch_trainer(trainer, **only("moe4bit"))
        print(report, flush=True)
    ids = torch.randint(3, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=s.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-4)

    def step(_i: int = 0) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def bench_model(s: Setup, rows: list[Row]) -> dict[str, float]:
    cfg = s.model
    dtype = str(s.dtype).replace("torch.", "")
    config = {**cfg, "experts": s.experts, "top_k": s.top_k, "dtype": dtype, "layout": "linear4bit"}
    tokens = cfg["batch"] * cfg["seq"]
    out = {}
    for name, patch in ((LOOP, False), (GROUPED, True)):
        with tempfile.TemporaryDirectory() as tmp:
            step = whole_model(s, patch, tmp)
        t = time_fn(step, warmup=s.warmup, reps=s.reps)
        mem = peak_memory(step)
        out[name] = t.p50
        rows.append(Row.timing(NAME, name, "train step", "tokens", tokens, t, **config))
        rows.append(Row(NAME, name, "train step", "memory", "GiB", "tokens", tokens, mem, config=config))
        print(f"model step {name:<20} {t.p50:9.2f} ms  peak {mem:.3f} GiB", flush=True)
        del step
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def summary(s: Setup, medians: dict[str, dict[int, float]], rows: list[Row], model: dict[str, float]) -> str:
    mem = {(r.provider, r.x_value): r.p50 for r in rows if r.metric == "memory" and r.mode == "fwd+bwd"}
    header = ["provider", *(f"{t} tok ms" for t in s.tokens), *(f"{t} tok GiB" for t in s.tokens)]
    table = [[name, *(v[t] for t in s.tokens), *(mem[(name, t)] for t in s.tokens)] for name, v in medians.items()]
    lines = [markdown_table(header, table), ""]
    mid = s.tokens[len(s.tokens) // 2]
    if LORA_LOOP in medians:
        loop, split = medians[LORA_LOOP][mid], medians[LORA_GROUPED][mid]
        lines.append(
            f"LoRA r={LORA_RANK} on every expert, {mid} tokens: PEFT per-expert loop {loop:.2f} ms, "
            f"grouped + split LoRA {split:.2f} ms ({loop / split:.1f}x; target >= 10x: "
            f"{'met' if loop >= 10 * split else 'NOT met'}); stacked target_parameters "
            f"{medians[LORA_STACKED][mid]:.2f} ms; "
            f"grouped + split LoRA / frozen grouped: {medians[LORA_GROUPED][mid] / medians[GROUPED][mid]:.2f}x."
        )
        lines.append("")
    if FLOOR not in medians:
        return "\n".join(lines)
    no_rc = f"{GROUPED} (no recompute)"
    header = ["tokens", "loop / grouped", "grouped / floor", "no-recompute / floor", "recompute saves GiB"]
    ratios = [
        [
            t,
            medians[LOOP][t] / medians[GROUPED][t],
            medians[GROUPED][t] / medians[FLOOR][t],
            medians[no_rc][t] / medians[FLOOR][t],
            mem[(no_rc, t)] - mem[(GROUPED, t)],
        ]
        for t in s.tokens
    ]
    lines += [markdown_table(header, ratios), ""]
    speedup, over_floor = medians[LOOP][mid] / medians[GROUPED][mid], medians[GROUPED][mid] / medians[FLOOR][mid]
    lines.append(
        f"At {mid} tokens (recompute on, the default): {speedup:.2f}x the loop (target >= 5.5x: "
        f"{'met' if speedup >= 5.5 else 'NOT met'}), {over_floor:.2f}x the pre-dequantized floor (target <= 1.1x: "
        f"{'met' if over_floor <= 1.1 else 'NOT met'}); without recompute "
        f"{medians[no_rc][mid] / medians[FLOOR][mid]:.2f}x the floor."
    )
    if model:
        lines.append(
            f"Whole-model training step ({s.model['layers']} gpt-oss-shaped layers, {s.experts} experts, top-"
            f"{s.top_k}, {s.model['batch']}x{s.model['seq']} tokens): loop {model[LOOP]:.1f} ms, grouped "
            f"{model[GROUPED]:.1f} ms ({model[LOOP] / model[GROUPED]:.2f}x)."
        )
    return "\n".join(lines)


PROFILED = (FLOOR, "transformers grouped_mm (dense weights)", GROUPED, f"{GROUPED} (no recompute)")
GEMM_OPS = ("aten::_grouped_mm", "aten::mm", "aten::bmm", "aten::addmm")
VIEW_OPS = {  # metadata-only ops: no kernel on a GPU
    f"aten::{n}"
    for n in "alias as_strided detach empty empty_like expand new_empty_strided reshape select slice squeeze t "
    "transpose unbind unflatten unsqueeze view".split()
}


def _outermost(prof) -> list:
    """Profiler events of aten / bitsandbytes ops not nested in another such op (what the Python code called)."""

    def is_op(event) -> bool:
        return event.name.startswith(("aten::", "bitsandbytes::"))

    def nested(event) -> bool:
        parent = event.cpu_parent
        while parent is not None and not is_op(parent):
            parent = parent.cpu_parent
        return parent is not None

    return [e for e in prof.events() if is_op(e) and not nested(e)]


def profile_summary(s: Setup, tokens: int, reps: int = 3) -> str:
    """Per provider (fwd+bwd): ops called, their CPU time outside GEMMs and dequantizes (the routing / gather /
    gate / combine overhead), GEMM and dequantize time; the best of ``reps`` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    fns = providers(s)
    lines = [f"CPU profile, {tokens} tokens ({str(s.dtype).replace('torch.', '')}, best of {reps}):"]
    for name in (name for name in PROFILED if name in fns):
        x, idx, weights, grad = layer_inputs(s, tokens, dense=name in DENSE_ROUTING)

        def step(fn=fns[name], x=x, idx=idx, weights=weights, grad=grad) -> None:
            x.grad = weights.grad = None
            fn(x, idx, weights).backward(grad)

        step()
        best = None
        for _ in range(reps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            events = _outermost(prof)
            gemm = [e for e in events if e.name in GEMM_OPS]
            deq = [e for e in events if e.name.startswith("bitsandbytes::")]
            rest = [e for e in events if e not in gemm and e not in deq]
            ms = [sum(e.cpu_time_total for e in group) / 1e3 for group in (rest, gemm, deq)]
            kernels = sum(e.name not in VIEW_OPS for e in rest)
            best = (ms, len(rest), kernels) if best is None or ms[0] < best[0][0] else best
        (rest_ms, gemm_ms, deq_ms), count, kernels = best
        lines.append(
            f"  {name:<42} {count:4d} ops ({kernels:3d} non-view), non-GEMM {rest_ms:8.2f} ms, "
            f"GEMM {gemm_ms:8.2f} ms, dequantize {deq_ms:7.2f} ms"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI smoke run)")
    parser.add_argument("--no-model", action="store_true", help="skip the whole-model training step")
    parser.add_argument("--profile", action="store_true", help="print a CPU-profile op summary per provider")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b", help="expert shapes (layer bench)")
    parser.add_argument("--lora-only", action="store_true", help="only the loop, grouped and LoRA providers")
    args = parser.parse_args()
    s = with_shape(SMOKE if args.smoke or not torch.cuda.is_available() else FULL, args.shape)
    name = NAME if args.shape == "gpt-oss-20b" else f"{NAME}_{args.shape.replace('-', '_')}"
    if s is SMOKE:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    out_dir = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    rows: list[Row] = []
    medians = bench_layers(s, rows, args.lora_only)
    model = {} if args.no_model else bench_model(s, rows)
    table = summary(s, medians, rows, model)
    out_dir = write_results(name, rows, table, out_dir)
    shown = [name for name in (LOOP, GROUPED, f"{GROUPED} (stacked)", FLOOR) if name in medians]
    shown += [n for n in (LORA_LOOP, LORA_GROUPED, LORA_STACKED) if n in medians]
    bar_plot(
        out_dir / f"{name}.png",
        f"MoE layer E={s.experts} top-{s.top_k} H={s.hidden} I={s.inter} {str(s.dtype).replace('torch.', '')} fwd+bwd",
        [f"{t} tok" for t in s.tokens],
        {name: [medians[name][t] for t in s.tokens] for name in shown},
        "ms (median)",
    )
    print(table)
    if args.profile:
        print(profile_summary(s, s.tokens[-1]))
    print(f"wrote {out_dir / name}.json/.md/.png")


if __name__ == "__main__":
    main()
