"""Recompute on or off for leantrain's grouped 4-bit experts, per expert layout and shape, from measurement.

One MoE block (router + experts) at the gpt-oss-20b layer shape (E 32, top-4, H = I = 2880) and the Qwen3-30B-A3B
layer shape (E 128, top-8, H 2048, I 768), bf16, 1 x 2048 and 1 x 4096 tokens, forward + backward into the hidden
states with the experts and router frozen (QLoRA). Public API only: a one-layer model of the family, a minimal
``transformers.Trainer``, ``leantrain.patch_trainer(trainer, moe4bit=True, moe_recompute=True / False)`` and
``leantrain.unpatch_trainer`` between the two. Layouts, as the installed transformers has them:

- ``3-D stacks`` (transformers 5): the stock experts quantized by ``leantrain.quantize_experts_4bit`` (nf4, double
  quantization); stock = transformers' own experts implementation (``grouped_mm``) over the same stacks, which
  dequantizes each stack on access and keeps it for the backward;
- ``Linear4bit lists`` (transformers 5): per-expert bitsandbytes ``Linear4bit`` lists (the community pre-quantized
  gpt-oss layout, ``testkit/moe4bit_models``; at the Qwen3 shape with SiLU experts); stock = the per-expert loop;
- ``4.x blocks`` (transformers 4.x only): the sparse MoE block's ModuleList of expert MLPs, every ``nn.Linear`` but
  the head nf4 (double quantization) as ``BitsAndBytesConfig(load_in_4bit)`` loads it; stock = the block's loop.
  Both shapes as Qwen3-MoE blocks (gpt-oss's own experts are 3-D there).

The promise the rule keeps: a layer's forward + backward through the grouped path never holds more memory than
transformers' own grouped experts over the same 4-bit stacks (which keeps every dequantized stack for the backward),
and within that the default is the faster setting. Budget = the peak of ``transformers grouped_mm`` on the 3-D stacks
at the same shape and length (for the lists and 4.x blocks too: the same expert GEMMs over stacks of the same size;
measured in this file's rows, also from a run under another transformers), + 5% of a bf16 gate_up stack for the
allocator's rounding; without that row: the peak with recompute on + the bf16 down stack (one more stack kept).
Rule: recompute off where its peak is within the budget and it is at least 3% faster than on; otherwise on.

    python benchmarks/probe_moe4bit_recompute.py            # CUDA (about 1-2 minutes on an H100)
    python benchmarks/probe_moe4bit_recompute.py --smoke    # CPU, tiny shapes
    python benchmarks/probe_moe4bit_recompute.py --report a.json b.json   # merge runs, decide again (CPU)

Writes ``moe4bit_recompute.json`` (rows; rows of other layouts already there are kept, so a run under transformers
4.x adds the 4.x blocks), ``.md`` (the verdict table) and ``moe4bit_recompute_verdict.json`` (per layout, shape and
length: recompute on/off with the measured ms and GiB) into ``$BENCH_RESULTS`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import shapes  # noqa: E402
import torch
import transformers
from _harness import RESULTS, Row, markdown_table, peak_memory, previous_rows, read_rows, time_fn, write_results  # noqa: E402
from recipes.runner import init_parameter  # noqa: E402
from recipes.settings import TINY_GPT_OSS, TINY_QWEN3_MOE  # noqa: E402

import leantrain  # noqa: E402
from testkit.optimizations import only  # noqa: E402


NAME = "moe4bit_recompute"
GIB = 2**30
FASTER = 0.97  # off must be at least 3% faster than on
ROUNDING = 0.05  # of a gate_up stack: allocator rounding allowed over the budget
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def layer_config(shape: str, smoke: bool, as_qwen3: bool) -> tuple[str, dict[str, Any]]:
    """(config class, fields) of a one-layer model at ``shape``; ``as_qwen3`` gives Qwen3-MoE blocks its sizes."""
    if smoke:
        fields = dict(TINY_GPT_OSS if shape == "gpt-oss-20b" else TINY_QWEN3_MOE)
    else:
        fields = shapes.config(shape)
    fields.update(num_hidden_layers=1, vocab_size=256)
    if shape == "gpt-oss-20b" and not as_qwen3:
        return "GptOssConfig", fields
    if shape == "gpt-oss-20b":  # the same expert GEMMs as a Qwen3-MoE block (SiLU experts)
        keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers")
        fields = {k: fields[k] for k in keep} | dict(
            vocab_size=256,
            num_experts=fields["num_local_experts"],
            num_experts_per_tok=fields["num_experts_per_tok"],
            moe_intermediate_size=fields["intermediate_size"],
            intermediate_size=fields["intermediate_size"],
            norm_topk_prob=True,
        )
    return "Qwen3MoeConfig", fields


def stack_gib(fields: dict[str, Any]) -> tuple[float, float]:
    """bf16 GiB of one layer's gate_up and down stacks."""
    experts = fields.get("num_local_experts") or fields["num_experts"]
    inter = fields.get("moe_intermediate_size") or fields["intermediate_size"]
    down = experts * inter * fields["hidden_size"] * 2 / GIB
    return 2 * down, down


def layouts() -> list[str]:
    return ["3-D stacks", "Linear4bit lists"] if TRANSFORMERS_5 else ["4.x blocks"]


def build(layout: str, shape: str, smoke: bool, device: str, dtype: torch.dtype):
    """A one-layer model in ``layout`` (seeded by parameter name), frozen, in train mode; its config fields."""
    from testkit.moe4bit_models import convert_model_to_linear4bit_experts, load_in_4bit_like

    cls, fields = layer_config(shape, smoke, as_qwen3=layout == "4.x blocks")
    config = getattr(transformers, cls)(**fields, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, param in model.named_parameters():
        init_parameter(name, param, 0.02)
    if layout == "3-D stacks":
        leantrain.quantize_experts_4bit(model, compress_statistics=True)
    elif layout == "Linear4bit lists":
        convert_model_to_linear4bit_experts(model)
    else:
        load_in_4bit_like(model, compute_dtype=dtype, double_quant=True)
    return model.requires_grad_(False).train(), fields


def providers(layout: str, trainer: Any):
    """(name, recompute or None, what runs) in turn, the model patched accordingly while the caller measures; a
    setting leantrain declines yields (name, reason string, "") instead of being timed."""
    impl = getattr(trainer.model.config, "_experts_implementation", None)
    yield (f"transformers {impl}" if layout == "3-D stacks" else "per-expert loop (stock)"), None, "unpatched"
    for recompute in (True, False):
        name = f"leantrain recompute {'on' if recompute else 'off'}"
        try:
            report = leantrain.patch_trainer(trainer, **only("moe4bit"), moe_recompute=recompute)
        except leantrain.NotReadyError as error:
            yield name, f"not served: {error}"[:300], ""
            continue
        print(f"[{layout}] {name}: {report['moe4bit'].detail}", flush=True)
        try:
            yield name, recompute, report["moe4bit"].detail[:300]
        finally:
            leantrain.unpatch_trainer(trainer)


def measure(layout: str, shape: str, smoke: bool, tokens: tuple[int, ...], rows: list[Row]) -> None:
    cuda = torch.cuda.is_available() and not smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model, fields = build(layout, shape, smoke, device, dtype)
    block = model.model.layers[0].mlp
    gate_up, down = stack_gib(fields)
    base = dict(layout=layout, shape=shape, experts_class=type(block.experts).__name__, dtype=str(dtype)[6:])
    base |= dict(gate_up_stack_gib=gate_up, down_stack_gib=down, transformers_version=transformers.__version__)
    base |= dict(experts_implementation=getattr(model.config, "_experts_implementation", None))
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(output_dir=tmp, report_to=[], save_strategy="no", use_cpu=not cuda)
        trainer = transformers.Trainer(model=model, args=args)
        reference: dict[int, torch.Tensor] = {}  # the stock block's output per length: same math everywhere?
        for name, setting, detail in providers(layout, trainer):
            held = torch.cuda.memory_allocated() / GIB if cuda else math.nan
            for n in tokens:
                served = not isinstance(setting, str)
                status = "ok" if served else setting
                config = base | dict(recompute=setting if served else None, resident_gib=held, status=status)
                config["detail"] = detail
                if not served:
                    rows.append(Row(NAME, name, "fwd+bwd", "memory", "GiB", "tokens", n, math.nan, config=config))
                    continue
                step, output = make_step(block, fields["hidden_size"], n, device, dtype)
                y = reference.setdefault(n, output())
                config["max_diff_vs_stock"] = ((output() - y).abs().max() / y.abs().max()).item()
                t = time_fn(step, warmup=1 if smoke else 3, reps=2 if smoke else 10)
                peak = peak_memory(step)
                rows.append(Row.timing(NAME, name, "fwd+bwd", "tokens", n, t, **config))
                rows.append(Row(NAME, name, "fwd+bwd", "memory", "GiB", "tokens", n, peak, config=config))
                print(f"{layout:<17} {shape:<14} {n:>5} {name:<26} {t.p50:8.2f} ms  peak {peak:.3f} GiB", flush=True)


def make_step(block: torch.nn.Module, hidden: int, tokens: int, device: str, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad = torch.randn(1, tokens, hidden, device=device, dtype=dtype, generator=gen)

    def forward() -> torch.Tensor:
        out = block(x)
        return out[0] if isinstance(out, tuple) else out

    def step(_i: int = 0) -> None:
        x.grad = None
        forward().backward(grad)

    def output() -> torch.Tensor:  # with grad enabled, as the timed path runs (the graph is dropped)
        return forward().detach().float()

    return step, output


def decide(on: tuple[float, float], off: tuple[float, float], budget: float) -> tuple[bool, str]:
    """(recompute, why) from (ms, peak GiB) with recompute on and off and the memory budget (GiB)."""
    if not all(math.isfinite(v) for v in (*on, *off, budget)):
        return True, "no CUDA memory measured: keep on"
    if off[1] > budget:
        return True, f"off holds {off[1]:.2f} GiB > budget {budget:.2f}"
    if off[0] > FASTER * on[0]:
        return True, f"off {off[0]:.2f} ms not 3% faster than on {on[0]:.2f} ms"
    return False, f"off {off[0]:.2f} ms vs on {on[0]:.2f} ms, {off[1]:.2f} GiB within budget {budget:.2f}"


def budget(got: dict[tuple, dict[str, float]], shape: str, tokens: int, on_gib: float, config: dict) -> tuple:
    """(GiB, where it comes from): stock grouped_mm's peak on the 3-D stacks, else recompute on + the down stack."""
    found = [(p, v.get("memory")) for (lay, s, n, p), v in got.items() if (lay, s, n) == ("3-D stacks", shape, tokens)]
    stock = [(p, m) for p, m in found if p.startswith("transformers") and m is not None and math.isfinite(m)]
    slack = ROUNDING * config["gate_up_stack_gib"]
    if stock:
        return stock[0][1] + slack, f"{stock[0][0]} on the 3-D stacks"
    return on_gib + config["down_stack_gib"] + slack, "recompute on + the down stack"


def verdicts(rows: list[Row]) -> list[dict[str, Any]]:
    got: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.config.get("status") == "ok":
            got.setdefault((r.config["layout"], r.config["shape"], r.x_value, r.provider), {})[r.metric] = r.p50
    out = []
    for (layout, shape, n, provider), on in sorted(got.items()):
        if provider != "leantrain recompute on" or (layout, shape, n, "leantrain recompute off") not in got:
            continue
        off = got[(layout, shape, n, "leantrain recompute off")]
        stock = next(
            (v for (lay, s, t, p), v in got.items() if (lay, s, t) == (layout, shape, n) and "leantrain" not in p), {}
        )
        config = next(r.config for r in rows if r.config["layout"] == layout and r.config["shape"] == shape)
        limit, source = budget(got, shape, n, on["memory"], config)
        recompute, why = decide((on["speed"], on["memory"]), (off["speed"], off["memory"]), limit)
        out.append(dict(
            layout=layout, shape=shape, tokens=n, recompute=recompute, why=why, on_ms=on["speed"],
            on_gib=on["memory"], off_ms=off["speed"], off_gib=off["memory"], stock_ms=stock.get("speed"),
            stock_gib=stock.get("memory"), budget_gib=limit, budget_from=source,
            transformers=config["transformers_version"],
        ))  # fmt: skip
    return out


def summary(found: list[dict[str, Any]]) -> str:
    header = ["layout", "shape", "tokens", "on ms / GiB", "off ms / GiB", "stock ms / GiB", "budget GiB", "recompute"]
    header.append("why")

    def pair(ms, g) -> str:
        return "-" if ms is None else f"{ms:.2f} / {g:.2f}"

    body = [
        [v["layout"], v["shape"], v["tokens"], pair(v["on_ms"], v["on_gib"]), pair(v["off_ms"], v["off_gib"]),
         pair(v["stock_ms"], v["stock_gib"]), f"{v['budget_gib']:.2f}", "on" if v["recompute"] else "off", v["why"]]
        for v in found
    ]  # fmt: skip
    per = {}
    for v in found:
        per.setdefault((v["layout"], v["shape"]), set()).add((v["tokens"], v["recompute"]))
    lines = [markdown_table(header, body), "", "Per layout and shape (the default the rule gives):", ""]
    for (layout, shape), settings in per.items():
        values = {r for _, r in settings}
        word = (
            ("on" if values == {True} else "off")
            if len(values) == 1
            else "mixed: " + ", ".join(f"{n} tokens {'on' if r else 'off'}" for n, r in sorted(settings))
        )
        lines.append(f"- {layout}, {shape}: recompute {word}")
    return "\n".join(lines)


def merge(old: list[Row], new: list[Row]) -> list[Row]:
    def key(r: Row) -> tuple:
        return (r.config.get("layout"), r.config.get("shape"), r.x_value, r.provider, r.metric)

    ran = {key(r) for r in new}
    return [r for r in old if key(r) not in ran] + list(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--shapes", default="gpt-oss-20b,qwen3-30b-a3b")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="merge these row files and decide again (CPU)")
    args = parser.parse_args()
    out_dir = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    if args.report:
        rows: list[Row] = []
        for path in args.report:
            rows = merge(rows, read_rows(Path(path)))
        write(rows, out_dir)
        return
    if args.smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    tokens = (32, 64) if args.smoke or not torch.cuda.is_available() else (2048, 4096)
    rows: list[Row] = []
    for layout in layouts():
        for shape in args.shapes.split(","):
            measure(layout, shape.strip(), args.smoke, tokens, rows)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    write(merge(previous_rows(NAME, out_dir, args.smoke), rows), out_dir)


def write(rows: list[Row], out_dir: Path) -> None:
    found = verdicts(rows)
    text = summary(found) + "\n\n" + __doc__.split("\n\n")[3]
    write_results(NAME, rows, text, out_dir)
    (out_dir / f"{NAME}_verdict.json").write_text(json.dumps(found, indent=1))
    print(summary(found))
    print(f"wrote {out_dir / NAME}.json/.md and {NAME}_verdict.json")


if __name__ == "__main__":
    main()
