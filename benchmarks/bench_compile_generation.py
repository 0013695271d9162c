"""GRPO / RLOO with compiled decoding: stock generate vs TRL's own ``cache_implementation="static"`` vs leantrain
(``patch_trainer`` defaults with ``compile_generation=True``), each variant in its own process with cold compile
caches, side by side: whole step, its generation part, the first step, peak memory and generated tokens/s.

    python benchmarks/bench_compile_generation.py                      # Qwen2.5-0.5B and 1.5B, beta 0.04, GRPO
    python benchmarks/bench_compile_generation.py --shapes qwen2.5-1.5b --betas 0 --trainer rloo
    python benchmarks/bench_compile_generation.py --shapes qwen2.5-7b --betas 0 --lora   # the GRPO LoRA 7B shape
    python benchmarks/bench_compile_generation.py --smoke              # tiny CPU run (tests)
    python benchmarks/bench_compile_generation.py --emit-rule RESULTS  # measured.py's rows from a results file

On the GPU machine: ``bash benchmarks/gpu_run.sh compile_generation`` (carry .whl with trl and datasets). Random-init
models of the released shapes (nothing downloaded), prompts of 16 words from leantrain.cli.tiny's corpus, 2 prompts x
8 generations x 256 new tokens a step, bf16, activation checkpointing (TRL's default). A step's generation part is
the time inside ``trainer._generate`` (CUDA-synchronized). Rows go to ``results/compile_generation.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _harness import RESULTS, Row, markdown_table, previous_rows, write_results


NAME = "compile_generation"
VARIANTS = ("stock", "trl_static", "leantrain")
SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b")
LABEL = {"stock": "stock generate", "trl_static": 'TRL cache_implementation="static"', "leantrain": "leantrain"}


def one(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant in this process: build, (patch), train ``steps`` steps, return per-step times and the rest."""
    from recipes.runner import checkpointing, dense_model, trainer_args
    from recipes.settings import QWEN, QWEN_7B, TINY

    import leantrain
    from leantrain.cli.demo import letter_reward
    from leantrain.cli.tiny import corpus_texts, train_tokenizer

    cuda = torch.cuda.is_available()
    s = _settings(cuda)
    fields = TINY if spec["smoke"] else QWEN_7B if spec["shape"] == "qwen2.5-7b" else QWEN[spec["shape"]]
    model = dense_model("Qwen2Config", fields, s)
    tok = train_tokenizer()
    tok.padding_side = "left"
    from datasets import Dataset

    prompts = Dataset.from_dict({"prompt": [" ".join(t.split()[:16]) for t in corpus_texts()[:64]]})
    out = Path(tempfile.mkdtemp(prefix="bench_compile_generation_"))
    if spec["beta"] > 0:  # TRL builds the reference model from the policy's path
        model.save_pretrained(out / "model")
        model.config._name_or_path = str(out / "model")
    common = dict(
        **trainer_args(out, spec["steps"], s),
        per_device_train_batch_size=spec["batch"],
        num_generations=spec["generations"],
        max_completion_length=spec["tokens"],
        beta=spec["beta"],
        learning_rate=1e-6,
        **checkpointing(cuda),
    )
    if spec["variant"] == "trl_static":
        common["cache_implementation"] = "static"
    if spec["trainer"] == "rloo":
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    else:
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    peft_config = None
    if spec["lora"]:  # r16 on every attention and MLP projection, the head frozen (the GRPO LoRA recipe's)
        from peft import LoraConfig

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets)
    trainer = Trainer(
        model=model,
        reward_funcs=letter_reward,
        args=Config(**common),
        train_dataset=prompts,
        processing_class=tok,
        peft_config=peft_config,
    )
    report = None
    if spec["variant"] == "leantrain":
        options = {"compile_generation": True}
        if spec["backend"]:
            options["compile_generation_backend"] = spec["backend"]
        report = leantrain.patch_trainer(trainer, **options)
    clock = _Clock(cuda)
    clock.install(trainer)
    trainer.train()
    stats = leantrain.compile_generation.stats(trainer) if report is not None else None
    return {
        **spec,
        "step_ms": clock.step_ms,
        "generation_ms": clock.generation_ms,
        "generated_tokens": clock.tokens,
        "completion_hash": clock.hashes[:1],
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "timed_peak_bytes": clock.timed_peak,
        "losses": [h.get("loss") for h in trainer.state.log_history if "loss" in h],
        "applied": list(report.applied) if report is not None else [],
        "report": str(report) if report is not None else "",
        "compiles": getattr(stats, "compiles", None),
        "cache_lengths": {str(k): v for k, v in getattr(stats, "lengths", {}).items()},
    }


def _settings(cuda: bool) -> Any:
    from recipes.settings import FULL, SMOKE

    return FULL if cuda else SMOKE


class _Clock:
    """Step boundaries from a callback, generation time from a wrapper on ``_generate`` (CUDA-synchronized)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.step_ms: list[float] = []
        self.generation_ms: list[float] = []
        self.tokens: list[int] = []
        self.hashes: list[str] = []
        self.timed_peak: int | None = None
        self._gen = 0.0
        self._tok = 0
        self._last = 0.0

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def install(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        clock = self
        original = trainer._generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            start = clock.now()
            result = original(*args, **kwargs)
            clock._gen += (clock.now() - start) * 1e3
            completions = [[int(t) for t in c] for c in result[1]]
            clock._tok += sum(map(len, completions))
            clock.hashes.append(hashlib.sha256(repr(completions).encode()).hexdigest()[:16])
            return result

        trainer._generate = generate

        class Steps(TrainerCallback):
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                clock._last = clock.now()

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                end = clock.now()
                clock.step_ms.append((end - clock._last) * 1e3)
                clock.generation_ms.append(clock._gen)
                clock.tokens.append(clock._tok)
                clock._gen, clock._tok, clock._last = 0.0, 0, end
                if clock.cuda:
                    if len(clock.step_ms) == 1:
                        torch.cuda.reset_peak_memory_stats()
                    else:
                        clock.timed_peak = torch.cuda.max_memory_allocated()
                clock._last = clock.now()

        trainer.add_callback(Steps())


def run_variant(spec: dict[str, Any], timeout: int) -> dict[str, Any]:
    """One variant in a child process with a fresh inductor cache directory (a cold first step, as a new run)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="inductor_") as cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        cmd = [sys.executable, __file__, "--one", json.dumps(spec)]
        started = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        return {**spec, "error": f"exit {proc.returncode}: {tail}"}
    result = json.loads(lines[-1][len("RESULT ") :])
    result["wall_s"] = time.perf_counter() - started
    return result


def rows_of(result: dict[str, Any]) -> list[Row]:
    """speed rows (whole step, generation), first step, peak memory and tokens/s of one variant."""
    config = {k: result[k] for k in ("shape", "beta", "trainer", "batch", "generations", "tokens", "steps", "lora")}
    config["compiles"], config["cache_lengths"] = result.get("compiles"), result.get("cache_lengths")
    config["completion_hash"] = result.get("completion_hash")
    x = f"{result['shape']}{' LoRA r16' if result['lora'] else ''} beta={result['beta']:g} {result['trainer']}"
    rows = []
    timed = slice(1, None)  # the first step (compiling, cold caches) is its own row
    for mode, values in (("step", result["step_ms"][timed]), ("generation", result["generation_ms"][timed])):
        if values:
            q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
            rows.append(Row(NAME, result["variant"], mode, "speed", "ms", "config", x, statistics.median(values),
                            q[1], q[7], config))  # fmt: skip
    first = result["step_ms"][0]
    rows.append(Row(NAME, result["variant"], "first_step", "speed", "ms", "config", x, first, config=config))
    gen_s = sum(result["generation_ms"][timed]) / 1e3
    if gen_s:
        rate = sum(result["generated_tokens"][timed]) / gen_s
        kind = ("throughput", "tokens/s", "config", x, rate)
        rows.append(Row(NAME, result["variant"], "generation", *kind, config=config))
    if result.get("timed_peak_bytes"):
        peak = result["timed_peak_bytes"] / 2**30
        rows.append(Row(NAME, result["variant"], "step", "memory", "GiB", "config", x, peak, config=config))
    return rows


def table(rows: list[Row]) -> str:
    by = {(r.x_value, r.provider, r.mode, r.metric): r.p50 for r in rows}
    configs = sorted({r.x_value for r in rows})
    body = []
    for x in configs:
        stock_step, stock_gen = by.get((x, "stock", "step", "speed")), by.get((x, "stock", "generation", "speed"))
        for v in VARIANTS:
            step, gen = by.get((x, v, "step", "speed")), by.get((x, v, "generation", "speed"))
            if step is None:
                continue
            first = by.get((x, v, "first_step", "speed"))
            body.append((
                x, LABEL[v], f"{step:,.0f}", f"{gen:,.0f}" if gen else "—",
                f"{stock_step / step:.2f}x" if stock_step else "—",
                f"{stock_gen / gen:.2f}x" if stock_gen and gen else "—",
                f"{first / 1e3:.1f}" if first else "—",
                f"{by.get((x, v, 'generation', 'throughput'), float('nan')):,.0f}",
                f"{by.get((x, v, 'step', 'memory'), float('nan')):.2f}",
            ))  # fmt: skip
    header = ("config", "variant", "step ms", "generation ms", "step vs stock", "generation vs stock",
              "first step s", "generated tokens/s", "peak GiB")  # fmt: skip
    return markdown_table(header, body)


def emit_rule(rows: list[Row]) -> str:
    """measured.py's rows: per shape, the saving per decoded token (generation ms over the completion length) and
    the compile cost (leantrain's first step over a warm stock step), leantrain against stock."""
    by = {(r.x_value, r.provider, r.mode): r for r in rows if r.metric == "speed"}
    lines = []
    for (x, provider, mode), row in sorted(by.items()):
        if provider != "leantrain" or mode != "generation" or (x, "stock", "generation") not in by:
            continue
        stock = by[(x, "stock", "generation")]
        tokens = row.config["tokens"]
        saving = (stock.p50 - row.p50) / tokens
        # the compile's cost: leantrain's first step over a warm stock step (stock's own first step is slow too:
        # CUDA's and the allocator's first-call costs, which leantrain's first step pays as well)
        first = by[(x, "leantrain", "first_step")].p50 - by[(x, "stock", "step")].p50
        lines.append(
            f"# {x}: generation {stock.p50:,.0f} -> {row.p50:,.0f} ms a call of {tokens} tokens, first step "
            f"{first / 1e3:.1f} s over a warm stock step ({row.device}, {row.date[:10]}, commit {row.commit})\n"
            f"saving_ms={saving:.2f}, compile_s={first / 1e3:.1f}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r.x_value, r.provider, r.mode): r.p50 for r in rows if r.metric == "speed"}
    configs = sorted({r.x_value for r in rows})
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
    for ax, x in zip(axes[0], configs):
        names = [v for v in VARIANTS if (x, v, "step") in by]
        gen = [by.get((x, v, "generation"), 0.0) / 1e3 for v in names]
        rest = [by[(x, v, "step")] / 1e3 - g for v, g in zip(names, gen)]
        ax.bar(range(len(names)), gen, label="generation")
        ax.bar(range(len(names)), rest, bottom=gen, label="rest of the step")
        ax.set_xticks(range(len(names)), [LABEL[v].replace(" cache_", "\ncache_") for v in names], fontsize=8)
        ax.set_ylabel("median step, s")
        ax.set_title(x, fontsize=10)
    axes[0][0].legend()
    fig.suptitle("GRPO step: stock vs TRL's static cache vs leantrain's compiled decoding")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--betas", default="0.04")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--trainer", choices=("grpo", "rloo"), default="grpo")
    parser.add_argument("--steps", type=int, default=4, help="steps per variant; the first is the cold one")
    parser.add_argument("--tokens", type=int, default=256, help="max_completion_length")
    parser.add_argument("--backend", default="", help="compile_generation_backend (default: leantrain's)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per variant")
    parser.add_argument("--lora", action="store_true", help="LoRA r16 on the 7 projections (e.g. --shapes qwen2.5-7b)")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes, 2 steps (tests)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--emit-rule", metavar="RESULTS_JSON", help="print measured.py's rows from a results file")
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(json.loads(args.one))), flush=True)
        return 0
    if args.emit_rule:
        from _harness import read_rows

        print(emit_rule(read_rows(Path(args.emit_rule))))
        return 0
    out = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    shapes = ["tiny-qwen2"] if args.smoke else args.shapes.split(",")
    steps, tokens = (2, 8) if args.smoke else (args.steps, args.tokens)
    rows: list[Row] = []
    failures = []
    for shape in shapes:
        for beta in (float(b) for b in args.betas.split(",")):
            for variant in args.variants.split(","):
                spec = dict(shape=shape, beta=beta, variant=variant, trainer=args.trainer, steps=steps, tokens=tokens,
                            batch=16 if not args.smoke else 4, generations=8 if not args.smoke else 4,
                            backend=args.backend or ("aot_eager" if args.smoke else ""), smoke=args.smoke,
                            lora=args.lora)  # fmt: skip
                result = run_variant(spec, args.timeout)
                if "error" in result:
                    failures.append(f"{shape} beta={beta:g} {variant}: {result['error']}")
                    print(f"FAILED {shape} beta={beta:g} {variant}:\n{result['error']}", flush=True)
                    continue
                print(
                    f"{shape} beta={beta:g} {variant}: steps {[round(t) for t in result['step_ms']]} ms, generation "
                    f"{[round(t) for t in result['generation_ms']]} ms, applied {result['applied']}, compiles "
                    f"{result['compiles']}, wall {result['wall_s']:.0f} s",
                    flush=True,
                )
                rows += rows_of(result)
                merged = save(rows, out, args.smoke)  # after every variant: a run cut off keeps what finished
    if rows:
        print(table(merged))
        print(emit_rule(merged))
    return 1 if failures else 0


def save(rows: list[Row], out: Path, smoke: bool) -> list[Row]:
    """This run's rows merged over the results file's (a config this run measured replaces its old rows), written
    with the table and the plot; returns the merged rows."""
    ours = {r.x_value for r in rows}
    merged = [r for r in previous_rows(NAME, out, smoke) if r.x_value not in ours] + rows
    write_results(NAME, merged, table(merged), out)
    plot(merged, out / f"{NAME}.png")
    return merged


if __name__ == "__main__":
    sys.exit(main())
