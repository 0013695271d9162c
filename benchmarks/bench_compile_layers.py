"""Compiled decoder layers (``compile_layers``) vs stock and vs ``patch_trainer`` without them, on one GPU:
Llama-3.2-1B shape (random init, real vocabulary 128256), LoRA r16 on all seven projections via PEFT (head frozen),
bf16, gradient checkpointing, AdamW, batch 4; a plain transformers Trainer with max_steps. Two data sets: fixed
4 x 2048 tokens, and variable lengths (lognormal, median ~500, clipped to [64, 2048], padded per batch: every step a
new width), tokens/s counted on real (unpadded) tokens. What ``compile_layers/measured.py`` records per family: the
step time saved (compiled vs ``leantrain``) and the compile cost (the first step's extra time with cold caches).

Variants, each in its own process (Dynamo state and inductor's in-memory caches would leak between them):
  stock                      the trainer as built
  leantrain                  patch_trainer(trainer, compile_layers=False): every other default
  compile                    patch_trainer(trainer, compile_layers=True): dynamic length from the first change
  compile_dynamic            ... compile_layers_dynamic="always" (dynamic from the start)
  compile_no_kernels         ... compile_layers=True, layer_kernels=False (inductor instead of Liger's kernels)
  naive                      patch_trainer(trainer, compile_layers=False) + layer.compile() per decoder layer
  compile_warm               compile again in a new process: inductor's on-disk caches are warm (second launch)

    python benchmarks/bench_compile_layers.py [--out DIR] [--variants stock/leantrain,compile,naive:fixed]
        [--sets fixed,var] [--timed N]   # CUDA; each variant capped at --per-variant-s (240 s)

``--variants``: ``a/b`` runs a and b in one process; ``:fixed`` or ``:fixed+var`` picks that variant's sets.

Writes compile_layers.json (rows appended as each variant finishes) into DIR, else $BENCH_RESULTS or
benchmarks/results/."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from _harness import RESULTS, git_commit  # noqa: E402


NAME = "compile_layers"
VARIANTS = ("stock/leantrain", "compile", "naive", "compile_warm:fixed", "compile_dynamic:var", "compile_no_kernels")
BATCH, SEQ, WARMUP = 4, 2048, 3


def lengths(n: int, seed: int = 0) -> list[int]:
    """Lognormal lengths with median ~500 (mu = ln 500, sigma 0.8), clipped to [64, 2048]."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(math.log(500) + 0.8 * torch.randn(n, generator=g))
    return [int(min(2048, max(64, x))) for x in raw.tolist()]


def rows(kind: str, n: int, vocab: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    sizes = [SEQ] * n if kind == "fixed" else lengths(n)
    return [{"input_ids": torch.randint(3, vocab, (k,), generator=g).tolist()} for k in sizes]


def make_trainer(kind: str, timed: int, out: str) -> Any:
    from peft import get_peft_model
    from recipes.dense_sft import LORA_TARGETS, build, lora
    from recipes.runner import checkpointing
    from recipes.settings import DENSE
    from transformers import Trainer, TrainingArguments, set_seed

    from testkit.batches import pad_right as pad

    s = SimpleNamespace(device="cuda", dtype=torch.bfloat16, dense_lora_r=16, cuda=True)
    spec = DENSE["llama-3.2-1b"]
    model = build(spec, s)
    set_seed(0)
    model = get_peft_model(model, lora(s))
    steps = WARMUP + timed
    args = TrainingArguments(
        output_dir=out, max_steps=steps, bf16=True, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, dataloader_num_workers=0, learning_rate=2e-4, per_device_train_batch_size=BATCH,
        **checkpointing(True),
    )  # fmt: skip
    data = rows(kind, steps * BATCH, spec["fields"]["vocab_size"])
    assert LORA_TARGETS  # the recipe's seven projections
    return Trainer(model=model, args=args, train_dataset=data, data_collator=pad)


class Clock:
    """Per-step wall time (CUDA-synchronized at step boundaries) and real tokens per step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._pending: list[torch.Tensor] = []
        self._t0 = 0.0

    def install(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        clock = self
        original = trainer.training_step

        def training_step(model: Any, inputs: dict, *a: Any, **k: Any) -> Any:
            clock._pending.append(inputs["attention_mask"].sum())
            return original(model, inputs, *a, **k)

        trainer.training_step = training_step

        class Timer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                clock._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                torch.cuda.synchronize()
                clock.times.append(time.perf_counter() - clock._t0)
                clock.tokens.append(int(sum(t.item() for t in clock._pending)))
                clock._pending = []

        trainer.add_callback(Timer())


def recompiles(trainer: Any) -> int | None:
    from leantrain.compile_layers import stats

    found = stats(trainer)
    return None if found is None else found.recompiles


def naive_compiles() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def run_one(variant: str, kind: str, timed: int) -> dict[str, Any]:
    from recipes.dense_sft import compile_layers as naive_compile

    import leantrain

    torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(kind, timed, out)
        report = None
        if variant != "stock":
            options: dict[str, Any] = {"compile_layers": variant.startswith("compile")}
            if variant == "compile_dynamic":
                options["compile_layers_dynamic"] = "always"
            if variant == "compile_no_kernels":
                options["layer_kernels"] = False
            report = leantrain.patch_trainer(trainer, **options)
        if variant == "naive":
            naive_compile("inductor")(trainer)
        clock = Clock()
        clock.install(trainer)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        times = clock.times[WARMUP:]
        tokens = clock.tokens[WARMUP:]
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        row = {
            "variant": variant,
            "set": kind,
            "first_step_s": round(clock.times[0], 2),
            "median_step_ms": round(1e3 * statistics.median(times), 1),
            "mean_step_ms": round(1e3 * statistics.fmean(times), 1),
            "p20_p80_ms": [round(1e3 * q, 1) for q in statistics.quantiles(times, n=5)[::3]],
            "tokens_per_s": round(sum(tokens) / sum(times), 1),
            "timed_steps": len(times),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "recompiles": recompiles(trainer) if variant != "naive" else None,
            "dynamo_unique_graphs": naive_compiles(),
            "train_wall_s": round(wall, 1),
            "losses_first_last": [losses[0], losses[-1]] if losses else None,
            "report": {o.name: [o.status.value, *o.reasons[:1]] for o in report.outcomes}
            if report is not None
            else None,
            "compile_detail": report["compile_layers"].detail if report is not None else None,
        }
        del trainer
    torch.cuda.empty_cache()
    return row


def child(args: argparse.Namespace) -> None:
    rows_out = []
    for variant in args.variant.split("/"):  # "stock/leantrain": variants that compile nothing share a process
        for kind in args.sets.split(","):
            timed = args.timed if kind == "var" else args.timed_fixed
            try:
                row = run_one(variant, kind, timed)
            except Exception as error:  # a variant that crashes is a result too
                row = {"variant": variant, "set": kind, "error": f"{type(error).__name__}: {error}"[:2000]}
            print(json.dumps(row), flush=True)
            rows_out.append(row)
            Path(args.child_out).write_text(json.dumps(rows_out))


def environment() -> dict[str, Any]:
    import transformers

    def version(name: str) -> str | None:
        try:
            return __import__(name).__version__
        except Exception:
            return None

    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": version("peft"),
        "liger_kernel": _dist_version("liger-kernel"),
        "bitsandbytes": _dist_version("bitsandbytes"),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": git_commit(),
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("BENCH_RESULTS", str(RESULTS)))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--sets", default="fixed,var")
    parser.add_argument("--timed", type=int, default=30)
    parser.add_argument("--timed-fixed", type=int, default=8)
    parser.add_argument("--per-variant-s", type=int, default=240)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        child(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"env": environment(), "setup": __doc__.split("\n\n")[0], "rows": []}
    with tempfile.TemporaryDirectory() as children:  # each child's rows, read back as it ends (not results)
        for spec in args.variants.split(","):
            result["rows"] += run_variant(spec, args, Path(children))
            (out / f"{NAME}.json").write_text(json.dumps(result, indent=1))


def run_variant(spec: str, args: argparse.Namespace, children: Path) -> list[dict[str, Any]]:
    """One variant's rows from its own process; a crash or the time cap is a row with ``error``."""
    variant, _, sets = spec.partition(":")  # "compile_warm:fixed" runs only that set
    path = children / f"child_{variant.replace('/', '_')}.json"
    sets = sets.replace("+", ",") or args.sets
    cmd = [sys.executable, __file__, "--variant", variant, "--sets", sets, "--timed", str(args.timed),
           "--timed-fixed", str(args.timed_fixed), "--child-out", str(path)]  # fmt: skip
    started = time.perf_counter()
    try:
        subprocess.run(cmd, timeout=args.per_variant_s, check=False)
        rows = json.loads(path.read_text()) if path.exists() else [{"variant": variant, "error": "no rows"}]
    except subprocess.TimeoutExpired:
        done = json.loads(path.read_text()) if path.exists() else []
        rows = done + [{"variant": variant, "error": f"timed out after {args.per_variant_s} s"}]
    print(f"== {variant}: {time.perf_counter() - started:.0f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()
