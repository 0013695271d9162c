"""The SFT loss head alone, forward + backward: N 8192 scored tokens through the LM head of Gemma-2-2B (H 2304,
V 256000), Qwen2.5-1.5B (1536, 151936) and Llama-3-8B (4096, 128256), bf16, frozen head (gradient into the hidden
states only, as under LoRA) and trainable head (full fine-tuning, PEFT modules_to_save).
The loss is ``Σ -log p(target) / num_items`` (TRL's ``nll`` and transformers' causal-LM loss). Every row is scored
(the floor's N): ignored rows would cost the fused heads that compact them (TRL's) less GEMM work than the others.

Providers:
- ``stock``: transformers' path: ``F.linear`` logits, upcast to fp32, ``F.cross_entropy(reduction="sum") / num_items``.
- ``trl_fused``: TRL >= 1.15's fused head as its SFT loss calls it (valid rows compacted, ``ChunkedLogProbFunction``
  with log_probs, entropy and is_top1, chunk 32768, ``masked_scatter`` back, ``-sum / num_items``).
- ``liger``: Liger-Kernel's fused linear cross-entropy (``reduction="sum"``, token accuracy on, as TRL's Liger path).
- ``cce``: cut-cross-entropy's ``linear_cross_entropy`` with ``filter_eps=None`` (exact gradients; its default
  ``"high"`` skips blocks of small gradient, an approximation).
- ``leantrain``: ``leantrain.lm_head.ops.head_loss`` with its defaults (entropy and top-1 flags computed as well).
- ``gemm_floor``: the N x H x V GEMMs no fused head can avoid (2 frozen: logits, dH; 3 trainable: + dW), plain
  ``torch.mm`` with the logits materialized; ``x floor`` is a provider's time over it.
A provider that is not installed (or needs CUDA on a CPU run) is skipped with a note; one that fails (e.g. out of
memory) is recorded as failed and the run goes on.

    python benchmarks/bench_fused_ce.py            # CUDA (H100: about 1.5 min)
    python benchmarks/bench_fused_ce.py --smoke    # tiny shape, CPU or GPU, seconds

Writes fused_ce.json / .md / .png into $BENCH_RESULTS or benchmarks/results/.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _harness import Row, bar_plot, markdown_table, peak_memory, time_fn, write_results  # noqa: E402

from leantrain.lm_head import ops  # noqa: E402


BENCH = "fused_ce"
N_TOKENS = 8192
FULL_SHAPES = [("gemma-2-2b", 2304, 256000), ("qwen2.5-1.5b", 1536, 151936), ("llama-3-8b", 4096, 128256)]
SMOKE_SHAPES = [("tiny", 32, 1001)]
SMOKE_TOKENS = 64
TRL_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what TRL's SFT head asks for (its logged metrics)
TRL_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (1.15-1.16)


def make_inputs(n: int, h: int, v: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=g)
    weight = torch.randn(v, h, device=device, dtype=dtype, generator=g) * (4 / h**0.5)  # logit std ~4
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    num_items = (targets != -100).sum()  # a tensor, as Trainer passes num_items_in_batch
    return hidden, weight, targets, num_items


# ----------------------------------------------------------------------------------------------- providers
# Each returns the scalar loss; gradients flow into hidden (and weight when it requires grad).
def stock(h, w, t, num_items):
    logits = F.linear(h, w).float()
    return F.cross_entropy(logits, t, ignore_index=-100, reduction="sum") / num_items


def _trl_function():
    """TRL's chunked log-prob autograd function (the one its fused head looks up in trl.trainer.utils)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    return ChunkedLogProbFunction


def trl_fused(h, w, t, num_items):
    mask = t != -100
    out = _trl_function().apply(h[mask], w, None, t[mask], 1.0, TRL_CHUNK, None, 1.0, TRL_OUTPUTS)
    log_probs = out[0].new_zeros(mask.shape).masked_scatter(mask, out[0])
    return -log_probs.sum() / num_items


def liger(h, w, t, num_items):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(h, w, t, reduction="sum", return_token_accuracy=True)
    return out.loss / num_items


def cce(h, w, t, num_items):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(e=h, c=w, targets=t, reduction="sum", filter_eps=None) / num_items


def leantrain(h, w, t, num_items):
    return ops.head_loss(h, w, t, loss_scale=1 / num_items).loss


PEERS = {
    # name: (function, module it needs, whether it needs CUDA)
    "stock": (stock, None, False),
    "trl_fused": (trl_fused, "trl.kernels.chunked_logprob", False),  # TRL >= 1.15
    "liger": (liger, "liger_kernel", True),
    "cce": (cce, "cut_cross_entropy", True),
    "leantrain": (leantrain, None, False),
}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (a dotted name imports its parents to look: a missing parent is False)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def providers(device: str) -> tuple[dict[str, Callable], list[str]]:
    """The runnable providers and a note for each one skipped."""
    found, notes = {}, []
    for name, (fn, module, needs_cuda) in PEERS.items():
        if needs_cuda and device != "cuda":
            notes.append(f"{name}: skipped (needs CUDA)")
        elif module is not None and not installed(module):
            notes.append(f"{name}: skipped ({module} is not installed)")
        else:
            found[name] = fn
    return found, notes


# ------------------------------------------------------------------------------------------------- timing
def gemm_count(trainable: bool) -> int:
    """The logits GEMM, dH = dZ @ W and, for a trainable head, dW = dZᵀ @ H (2·N·H·V flops each)."""
    return 3 if trainable else 2


def gemm_floor(hidden, weight, trainable: bool, reps: int, warmup: int):
    logits = torch.empty(hidden.shape[0], weight.shape[0], device=hidden.device, dtype=hidden.dtype)

    def step(_i=0):
        torch.mm(hidden, weight.t(), out=logits)
        torch.mm(logits, weight)
        if trainable:
            torch.mm(logits.t(), hidden)

    return time_fn(step, warmup=warmup, reps=reps)


def bench_provider(fn, hidden, weight, targets, num_items, trainable: bool, reps: int, warmup: int):
    def step(_i=0):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_(trainable)
        fn(h, w, targets, num_items).backward()

    return time_fn(step, warmup=warmup, reps=reps), peak_memory(step)


def run(smoke: bool) -> tuple[list[Row], str, dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not smoke and device != "cuda":
        sys.exit("the full benchmark needs CUDA; use --smoke on CPU")
    if device == "cpu":
        torch.set_num_threads(1)
    shapes, n = (SMOKE_SHAPES, SMOKE_TOKENS) if smoke else (FULL_SHAPES, N_TOKENS)
    reps, warmup = (2, 1) if smoke else (10, 3)
    dtype = torch.bfloat16
    found, notes = providers(device)
    for note in notes:
        print(note, flush=True)
    rows: list[Row] = []
    table: list[list] = []
    plot: dict[str, list[float]] = {}
    groups: list[str] = []
    for model, h, v in shapes:
        hidden, weight, targets, num_items = make_inputs(n, h, v, device, dtype)
        for trainable in (False, True):
            head = "trainable" if trainable else "frozen"
            label = f"{model} (H {h}, V {v}) {head}"
            groups.append(label)
            x_value = f"{model} {head}"
            config = dict(model=model, N=n, H=h, V=v, dtype=str(dtype), trainable_head=trainable,
                          gemms=gemm_count(trainable))  # fmt: skip
            floor = gemm_floor(hidden, weight, trainable, reps, warmup)
            rows.append(Row.timing(BENCH, "gemm_floor", "full", "case", x_value, floor, **config))
            print(f"{label:44s} {'gemm_floor':11s} {floor.p50:9.2f} ms", flush=True)
            results = {}
            for name, fn in found.items():
                try:
                    t, mem = bench_provider(fn, hidden, weight, targets, num_items, trainable, reps, warmup)
                except Exception as error:  # out of memory, a peer's unsupported shape: recorded, the run goes on
                    notes.append(f"{name} at {label}: failed ({type(error).__name__}: {str(error)[:160]})")
                    print(notes[-1], flush=True)
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                results[name] = (t, mem)
                ratio = t.p50 / floor.p50
                rows.append(Row.timing(BENCH, name, "full", "case", x_value, t, **config))
                rows.append(Row(BENCH, name, "full", "memory", "GiB", "case", x_value, mem, config=config))
                extra = {**config, "floor_ms": floor.p50}
                rows.append(Row(BENCH, name, "full", "x_floor", "ratio", "case", x_value, ratio, config=extra))
                print(f"{label:44s} {name:11s} {t.p50:9.2f} ms  {mem:7.3f} GiB  {ratio:5.2f}x floor", flush=True)
            trl = results.get("trl_fused", (None,))[0]
            for name, (t, mem) in results.items():
                vs_trl = trl.p50 / t.p50 if trl is not None else float("nan")
                table.append([label, name, t.p50, t.p20, t.p80, mem, t.p50 / floor.p50, vs_trl])
            table.append([label, "gemm_floor", floor.p50, floor.p20, floor.p80, float("nan"), 1.0, float("nan")])
            for name in found:
                plot.setdefault(name, []).append(results[name][0].p50 if name in results else 0.0)
            plot.setdefault("gemm_floor", []).append(floor.p50)
        del hidden, weight, targets
        if device == "cuda":
            torch.cuda.empty_cache()
    header = ["case", "provider", "median ms", "p20 ms", "p80 ms", "peak GiB", "x floor", "speed-up vs TRL"]
    md = markdown_table(header, table)
    md += (
        f"\n\nN {n} tokens (all scored), bf16, loss = Σ -log p / num_items, forward + backward. "
        "x floor: time over the N x H x V GEMMs alone (2 frozen, 3 trainable; cuBLAS, logits materialized). "
        "Peak GiB: allocated above the inputs during one step."
    )
    if notes:
        md += "\n\n" + "\n".join(f"- {note}" for note in notes)
    return rows, md, dict(groups=groups, plot=plot)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shape, few reps (CPU ok)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows, md, plot = run(args.smoke)
    out = write_results(BENCH, rows, md)
    try:
        bar_plot(out / f"{BENCH}.png", "SFT loss head fwd+bwd (median ms, lower is better)", plot["groups"],
                 plot["plot"], "ms")  # fmt: skip
    except Exception as error:  # matplotlib missing is not a benchmark failure
        print(f"plot skipped: {error}")
    print(md)
    print(f"results in {out}")


if __name__ == "__main__":
    main()
