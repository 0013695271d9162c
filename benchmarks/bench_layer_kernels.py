"""Layer kernels benchmark: stock transformers modules vs leantrain ``layer_kernels`` (Liger-Kernel's RMSNorm,
SwiGLU / GeGLU and RoPE bound on the module instances), forward + backward, bf16, 4 x 2048 tokens.

Per shape (Gemma-2-2B, Qwen2.5-1.5B, Llama-3.2-1B; random weights, the released configs' sizes):
1. one whole decoder layer (attention in the model's implementation: eager for Gemma 2, sdpa otherwise), the
   patched instance against a stock copy: what the kernels change in a layer's time and peak memory;
2. each kernel alone against the stock module's arithmetic: RMSNorm, the gated activation (``act(gate) * up``) and
   RoPE on q and k.

    python benchmarks/bench_layer_kernels.py            # CUDA (~1 min on an H100)
    python benchmarks/bench_layer_kernels.py --smoke    # CPU, tiny shapes, torch stand-ins for the kernels (seconds)

The smoke run drives the same code with testkit/layer_kernels_refs.py's stand-ins (Liger's kernels are CUDA-only),
so it checks the script, not the kernels. Writes ``layer_kernels.{json,md,png}`` into ``$BENCH_RESULTS`` or
``benchmarks/results/`` (the smoke run into a temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import shapes  # noqa: E402
import torch
from _harness import RESULTS, Row, bar_plot, markdown_table, peak_memory, time_fn, write_results  # noqa: E402

from leantrain.fallback import RuntimeFallback  # noqa: E402
from leantrain.layer_kernels import FAMILIES, ops  # noqa: E402
from leantrain.layer_kernels.patch import install  # noqa: E402
from leantrain.layer_kernels.probe import plan_targets  # noqa: E402
from leantrain.undo import Undo  # noqa: E402


NAME = "layer_kernels"
SHAPES = {"gemma-2-2b": "gemma2", "qwen2.5-1.5b": "qwen2", "llama-3.2-1b": "llama"}
TINY = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@dataclasses.dataclass(frozen=True)
class Settings:
    device: str
    dtype: torch.dtype
    batch: int
    seq: int
    reps: int
    warmup: int
    tiny: bool


FULL = Settings("cuda", torch.bfloat16, 4, 2048, 20, 3, False)
SMOKE = Settings("cpu", torch.float32, 2, 32, 2, 1, True)


def one_layer_model(shape: str, s: Settings) -> torch.nn.Module:
    """A one-layer causal LM of the shape (the layer and its rotary embedding are what is timed)."""
    import transformers

    spec = shapes.shape(shape)
    fields = spec.config(num_hidden_layers=1, **(TINY if s.tiny else {}))
    attention = "eager" if spec.cls == "Gemma2Config" or not s.device == "cuda" else "sdpa"
    config = getattr(transformers, spec.cls)(**fields)
    config.vocab_size = 128  # the embedding and head are not timed
    torch.manual_seed(0)
    with torch.device(s.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=s.dtype, attn_implementation=attention)
    return model.train()


def patched_copy(model: torch.nn.Module, family: str) -> torch.nn.Module:
    twin = copy.deepcopy(model)
    readiness = plan_targets(twin, family, FAMILIES[family], "benchmark")
    assert readiness.ready, readiness.reasons
    install(readiness.plan, Undo(), RuntimeFallback(NAME, strict=True))  # strict: a kernel failure raises
    return twin


def layer_step(model: torch.nn.Module, s: Settings) -> Callable[[int], Any]:
    """Forward + backward of the decoder layer on [batch, seq, hidden] inputs (position embeddings precomputed)."""
    layer = model.model.layers[0]
    hidden = model.config.hidden_size
    x = torch.randn(s.batch, s.seq, hidden, device=s.device, dtype=s.dtype, requires_grad=True)
    positions = torch.arange(s.seq, device=s.device)[None].expand(s.batch, -1)
    with torch.no_grad():
        cos_sin = model.model.rotary_emb(x, positions)
    grad = torch.randn_like(x)

    def step(i: int) -> None:
        out = layer(x, position_embeddings=cos_sin, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        x.grad = None

    return step


def kernel_steps(model: torch.nn.Module, family: str, s: Settings) -> dict[str, dict[str, Callable[[int], Any]]]:
    """{kernel: {provider: fwd+bwd step}}: the stock module arithmetic vs leantrain's op, on the layer's sizes."""
    spec, config = FAMILIES[family], model.config
    layer = model.model.layers[0]
    norm, mlp = layer.input_layernorm, layer.mlp
    n, heads, kv = s.batch * s.seq, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    def leaf(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=s.device, dtype=s.dtype, requires_grad=True)

    x, gate, up = leaf(n, config.hidden_size), leaf(n, config.intermediate_size), leaf(n, config.intermediate_size)
    q, k = leaf(s.batch, heads, s.seq, head_dim), leaf(s.batch, kv, s.seq, head_dim)
    positions = torch.arange(s.seq, device=s.device)[None].expand(s.batch, -1)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(q, positions)
    modeling = sys.modules[type(model).__module__]
    eps = getattr(norm, spec.norm_eps)
    gated = getattr(ops, spec.gate)

    def fwd_bwd(fn: Callable[[], Any], *leaves: torch.Tensor) -> Callable[[int], None]:
        def step(i: int) -> None:
            out = fn()
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            for t in (*leaves, norm.weight):
                t.grad = None

        return step

    return {
        "rms_norm": {
            "stock": fwd_bwd(lambda: type(norm).forward(norm, x), x),
            "leantrain": fwd_bwd(lambda: ops.rms_norm(x, norm.weight, eps, spec.offset, spec.casting), x),
        },
        spec.gate: {
            "stock": fwd_bwd(lambda: mlp.act_fn(gate) * up, gate, up),
            "leantrain": fwd_bwd(lambda: gated(gate, up), gate, up),
        },
        "rope": {  # fresh q, k per call (q * 1): Liger rotates its inputs in their storage
            "stock": fwd_bwd(lambda: modeling.apply_rotary_pos_emb(q * 1, k * 1, cos, sin), q, k),
            "leantrain": fwd_bwd(lambda: ops.rope(q * 1, k * 1, cos, sin), q, k),
        },
    }


def measure(shape: str, s: Settings) -> list[Row]:
    family = SHAPES[shape]
    model = one_layer_model(shape, s)
    mine = patched_copy(model, family)
    tokens = s.batch * s.seq
    rows = []
    cases = {"decoder layer": {"stock": layer_step(model, s), "leantrain": layer_step(mine, s)}}
    cases.update(kernel_steps(model, family, s))
    for mode, providers in cases.items():
        for provider, step in providers.items():
            timing = time_fn(step, warmup=s.warmup, reps=s.reps)
            peak = peak_memory(lambda: step(0))
            rows.append(Row.timing(NAME, provider, mode, "shape", shape, timing, tokens=tokens, peak_gib=peak))
            print(f"{shape:>14} {mode:<14} {provider:<10} {timing.p50:8.3f} ms  peak {peak:.3f} GiB", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    body = []
    for shape in dict.fromkeys(r.x_value for r in rows):
        for mode in dict.fromkeys(r.mode for r in rows if r.x_value == shape):
            cell = {r.provider: r for r in rows if r.x_value == shape and r.mode == mode}
            stock, mine = cell["stock"], cell["leantrain"]
            body.append([
                shape, mode, f"{stock.p50:.3f}", f"{mine.p50:.3f}", f"{stock.p50 / mine.p50:.2f}x",
                f"{stock.config['peak_gib']:.3f}", f"{mine.config['peak_gib']:.3f}",
            ])  # fmt: skip
    header = ["shape", "fwd+bwd of", "stock ms (p50)", "leantrain ms (p50)", "speed-up", "stock peak GiB",
              "leantrain peak GiB"]  # fmt: skip
    return markdown_table(header, body)


@contextlib.contextmanager
def stand_ins(s: Settings) -> Iterator[None]:
    if s.device == "cuda":
        yield
        return
    from testkit.layer_kernels_refs import emulated

    with emulated():
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with torch stand-ins (seconds)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else FULL
    if s.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs CUDA; use --smoke on CPU")
    if s.device == "cpu":
        torch.set_num_threads(1)  # tiny CPU shapes: a second thread only adds contention (and spin-waits)
    default = Path(tempfile.gettempdir()) / "leantrain_layer_kernels_smoke" if args.smoke else RESULTS
    out = Path(os.environ.get("BENCH_RESULTS", default))
    rows: list[Row] = []
    with stand_ins(s):
        for shape in [x.strip() for x in args.shapes.split(",") if x.strip()]:
            rows += measure(shape, s)
    text = table(rows)
    write_results(NAME, rows, text, out)
    groups = [f"{r.x_value}\n{r.mode}" for r in rows if r.provider == "stock"]
    series = {p: [r.p50 for r in rows if r.provider == p] for p in ("stock", "leantrain")}
    bar_plot(out / f"{NAME}.png", "fwd+bwd, bf16, 4 x 2048 tokens", groups, series, "ms")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
