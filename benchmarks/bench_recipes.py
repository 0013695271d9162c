"""Whole training steps of real recipes, stock vs leantrain: what ``patch_trainer`` changes in a step, measured.

Random-init public shapes with their real vocab sizes (nothing downloaded); one GPU call per recipe, each under
8 minutes on an H100 including the model builds (a time budget skips what would not fit, recorded as "skipped"):

- ``grpo``: TRL ``GRPOTrainer``, Qwen2.5-0.5B and 1.5B shapes, 16 completions per step (2 prompts x 8 generations)
  x 256 completion tokens, beta 0.04 (reference model) and beta 0: stock vs ``patch_trainer(grpo_logps=True)``.
  Every step's completion token count and a hash of the completion token ids are recorded (same completions?).
- ``sft``: TRL ``SFTTrainer``, Qwen2.5-0.5B and 1.5B shapes, batch 8 x 2048, bf16, gradient checkpointing: stock
  vs CGGR (``cggr=True``, ratio 0.25 and 0.5, ``cggr_warmup_steps=0``).
- ``moe_qlora``: the gpt-oss-20b shape (24 layers, 32 experts, top-4, hidden 2880, vocab 201088), LoRA r=16 on the
  attention projections, experts frozen; batch 2 x 2048. Variants: leantrain's grouped 4-bit path on
  ``quantize_experts_4bit`` stacks and on per-expert ``bnb.nn.Linear4bit`` lists (community checkpoint layout),
  each against the same layout unpatched (transformers' dequantize-on-access stacks; the per-expert loop), and stock
  transformers with bf16 experts ("oom" when it does not fit). Built on the meta device and materialized one layer
  at a time on the GPU, its experts quantized as it appears (never all bf16 experts at once); build time recorded.
- ``osft``: Llama-3.2-1B shape, SFT batch 4 x 2048, fp32 weights under bf16 autocast: dense full fine-tuning vs
  leantrain ``osft=True`` vs mini_trainer 0.9.0's OSFT model class and projections (leantrain's initial factors,
  no second SVD; run in the same HF Trainer, projections in the optimizer callbacks).

Per step after warm-up: total time (``on_step_begin`` -> ``on_step_end``, CUDA-synchronized) split into exclusive
parts: ``generation`` (``_generate``), ``logps`` (old/reference log-probs: ``_get_per_token_logps_and_entropies``
without grad), ``prepare`` (the rest of ``_prepare_inputs``: rewards, advantages), ``forward`` (``compute_loss``),
``backward`` (the rest of ``training_step``), ``clip`` (``_clip_grad_norm``), ``optimizer``
(``on_pre_optimizer_step`` -> ``on_optimizer_step``, OSFT projections included) and ``other`` (scheduler,
zero_grad, callbacks); tokens/s; peak memory above what was allocated before the variant was built; per-step losses.

    python benchmarks/bench_recipes.py --recipe grpo        # one recipe (CUDA); also sft, moe_qlora, osft
    python benchmarks/bench_recipes.py                      # --recipe all: the four in turn (~25 min)
    python benchmarks/bench_recipes.py --smoke              # every recipe on tiny shapes on CPU (< 60 s)
    python benchmarks/bench_recipes.py --smoke --device cuda    # the same on the GPU: its CUDA paths, in seconds
    python benchmarks/bench_recipes.py --merge a.json b.json    # rebuild recipes.{json,md,png} from several runs
    BENCH_RECIPE=grpo BENCH_RECIPE_SHAPES=qwen2.5-0.5b bash benchmarks/gpu_run.sh recipes   # the same, by env vars

``--shapes`` (grpo / sft), ``--only`` (variant-name substrings) and ``--budget-s`` select less; their environment
twins are BENCH_RECIPE_SHAPES, BENCH_RECIPE_ONLY and BENCH_RECIPE_BUDGET_S.

Writes ``recipes.json`` (rows of every recipe run so far: the rows already in ``$BENCH_RESULTS/recipes.json``, else
in ``benchmarks/results/recipes.json``, with the (recipe, config) pairs just run replaced), ``recipes.md`` and
``recipes.png`` (step time per variant, split stacked, one panel per recipe) into ``$BENCH_RESULTS`` or
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import hashlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/ scaffolding (tests._moe4bit_models)
from _harness import (  # noqa: E402
    QWEN25_SHAPES,
    RESULTS,
    Row,
    markdown_table,
    read_rows,
    stacked_bar_panels,
    write_results,
)


NAME = "recipes"
RECIPES = ("grpo", "sft", "moe_qlora", "osft")
PARTS = ("generation", "logps", "prepare", "forward", "backward", "clip", "optimizer", "other")
SHORT = dict(
    generation="gen",
    logps="logps",
    prepare="prep",
    forward="fwd",
    backward="bwd",
    clip="clip",
    optimizer="opt",
    other="other",
)
TOKENS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)  # leantrain.tiny's tokenizer
# Every leantrain option explicit (CGGR is opt-in, the others auto): a variant turns exactly one on.
ONLY = dict(cggr=False, grpo_logps=False, osft=False, moe4bit=False)
LOG_KEYS = ("cggr/kept_fraction", "cggr/score_ms", "completions/mean_length", "reward", "kl", "entropy", "grad_norm")
START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.0f} s, cpu {time.process_time():5.0f} s] {message}", flush=True)


# -- shapes and settings -------------------------------------------------------------------------------------------

QWEN = {  # released configs (tied embeddings); rope settings do not change the cost
    name: dict(fields, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6)
    for name, fields in QWEN25_SHAPES.items()
}
LLAMA_1B = dict(  # Llama-3.2-1B
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
)
GPT_OSS_20B = dict(  # openai/gpt-oss-20b (GptOssConfig defaults: yarn rope, swiglu limit 7, attention bias)
    num_hidden_layers=24,
    num_local_experts=32,
    num_experts_per_tok=4,
    hidden_size=2880,
    intermediate_size=2880,
    vocab_size=201088,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    sliding_window=128,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
# Smoke: vocab 2048 = leantrain.tiny's tokenizer (GRPO prompts are real text); 4-bit sizes are multiples of the
# blocksize (bitsandbytes' CPU dequantize needs it, see tests/parity/test_moe4bit_model.py).
TINY = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
TINY_GPT_OSS = dict(
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    hidden_size=128,
    intermediate_size=64,
    vocab_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    sliding_window=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: torch.dtype
    grpo_shapes: dict[str, dict]
    grpo_batch: int  # completions per step
    grpo_generations: int
    grpo_completion: int
    grpo_betas: tuple[float, ...]
    grpo_steps: tuple[int, int]  # warm-up, timed
    sft_shapes: dict[str, dict]
    sft_batch: int
    sft_seq: int
    sft_ratios: tuple[float, ...]
    sft_steps: tuple[int, int]
    moe_shape: dict
    moe_batch: int
    moe_seq: int
    moe_steps: tuple[int, int]
    lora_r: int
    osft_name: str
    osft_shape: dict
    osft_batch: int
    osft_seq: int
    osft_steps: tuple[int, int]
    budget_s: float  # per recipe

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


FULL = Settings(
    device="cuda",
    dtype=torch.bfloat16,
    grpo_shapes=QWEN,
    grpo_batch=16,  # 2 prompts x 8 generations: generation is latency-bound, more prompts barely add time
    grpo_generations=8,
    grpo_completion=256,
    grpo_betas=(0.04, 0.0),
    grpo_steps=(2, 4),
    sft_shapes=QWEN,
    sft_batch=8,
    sft_seq=2048,
    sft_ratios=(0.25, 0.5),
    sft_steps=(2, 5),
    moe_shape=GPT_OSS_20B,
    moe_batch=2,
    moe_seq=2048,
    moe_steps=(2, 4),
    lora_r=16,
    osft_name="llama-1b",
    osft_shape=LLAMA_1B,
    osft_batch=4,
    osft_seq=2048,
    osft_steps=(2, 5),
    budget_s=450.0,
)
SMOKE = Settings(  # fp32: CPUs without bf16 matmul units run bf16 slowly
    device="cpu",
    dtype=torch.float32,
    grpo_shapes={"tiny-qwen2": TINY},
    grpo_batch=4,
    grpo_generations=4,
    grpo_completion=4,
    grpo_betas=(0.04, 0.0),
    grpo_steps=(1, 1),
    sft_shapes={"tiny-qwen2": TINY},
    sft_batch=2,
    sft_seq=64,
    sft_ratios=(0.25, 0.5),
    sft_steps=(1, 1),
    moe_shape=TINY_GPT_OSS,
    moe_batch=2,
    moe_seq=32,
    moe_steps=(1, 1),
    lora_r=4,
    osft_name="tiny-llama",
    osft_shape=TINY,
    osft_batch=2,
    osft_seq=64,
    osft_steps=(1, 1),
    budget_s=1e9,
)


# -- per-step clock ------------------------------------------------------------------------------------------------


class StepClock:
    """Per-step wall time of one trainer and its exclusive split (PARTS), CUDA-synchronized at every boundary.

    Timed methods are wrapped on the trainer instance (after leantrain patched it, so the timers are outermost); a
    nested timed call is subtracted from its caller, so the parts never overlap and sum to at most the step."""

    def __init__(self, cuda: bool, label: str) -> None:
        self.cuda, self.label = cuda, label
        self.frames: list[list[float]] = []  # [start, time of timed children (ms)]
        self.parts: dict[str, float] = {}
        self.extra: dict[str, Any] = {}
        self.tokens = 0
        self.steps: list[dict[str, Any]] = []
        self.begin = self.opt_begin = 0.0
        self.last_end: float | None = None

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, part: str, ms: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + ms

    def wrap(
        self,
        obj: Any,
        attr: str,
        part: str,
        when: Callable[[], bool] | None = None,
        after: Callable[[Any, tuple], None] | None = None,
    ) -> None:
        original = getattr(obj, attr)
        clock = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if when is not None and not when():
                return original(*args, **kwargs)
            frame = [clock.now(), 0.0]
            clock.frames.append(frame)
            try:
                result = original(*args, **kwargs)
            finally:
                inclusive = (clock.now() - frame[0]) * 1e3
                clock.frames.pop()
                clock.add(part, inclusive - frame[1])
                if clock.frames:
                    clock.frames[-1][1] += inclusive
            if after is not None:
                after(result, args)
            return result

        setattr(obj, attr, timed)

    def install(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        clock = self

        class First(TrainerCallback):  # runs before every other callback
            def on_step_begin(self, args, state, control, **kwargs):
                clock.parts, clock.extra, clock.tokens = {}, {}, 0
                clock.begin = clock.now()

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                clock.opt_begin = clock.now()

        class Last(TrainerCallback):  # runs after every other callback (OSFT projections included)
            def on_optimizer_step(self, args, state, control, **kwargs):
                clock.add("optimizer", (clock.now() - clock.opt_begin) * 1e3)

            def on_step_end(self, args, state, control, **kwargs):
                clock.step_end(state.global_step)

        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the per-step progress lines below replace its log dicts
        trainer.callback_handler.callbacks.insert(0, First())
        trainer.add_callback(Last())
        self.wrap(trainer, "training_step", "backward", after=self._count_tokens)
        self.wrap(trainer, "_prepare_inputs", "prepare")
        self.wrap(trainer, "compute_loss", "forward")
        self.wrap(trainer, "_clip_grad_norm", "clip")

    def _count_tokens(self, result: Any, args: tuple) -> None:
        inputs = args[1] if len(args) > 1 else None
        if isinstance(inputs, dict) and torch.is_tensor(inputs.get("input_ids")):
            mask = inputs.get("attention_mask")
            self.tokens += int(mask.sum()) if torch.is_tensor(mask) else inputs["input_ids"].numel()

    def step_end(self, step: int) -> None:
        end = self.now()
        total = (end - self.begin) * 1e3
        parts = {p: self.parts.get(p, 0.0) for p in PARTS[:-1]}
        parts["other"] = total - sum(parts.values())
        cycle = None if self.last_end is None else (end - self.last_end) * 1e3
        self.last_end = end
        self.steps.append(
            {"step": step, "total_ms": total, "cycle_ms": cycle, "parts": parts, "tokens": self.tokens, **self.extra}
        )
        split = ", ".join(f"{SHORT[p]} {v:.0f}" for p, v in parts.items() if v >= 0.5)
        log(f"  {self.label} step {step}: {total:.0f} ms ({split})")


# -- running one variant -------------------------------------------------------------------------------------------


@dataclass
class Variant:
    recipe: str
    config: str
    name: str
    kind: str  # stock / leantrain / peer / reference
    baseline: str | None
    make: Callable[[], Any]  # -> trainer, or (trainer, extra dict)
    patch: Callable[[Any], Any] | None = None  # -> PatchReport
    hooks: Callable[[Any, StepClock], None] | None = None  # recipe timers / callbacks after the clock
    settings: dict[str, Any] = field(default_factory=dict)
    skip: str | None = None  # recorded as skipped with this reason


class Budget:
    """Skip a group of variants when the remaining recipe time would not hold it (estimate: the longest so far)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start, self.longest = seconds, time.perf_counter(), 0.0

    def allows(self, count: int = 1) -> bool:
        return time.perf_counter() - self.start + count * self.longest <= self.seconds

    def record(self, wall_s: float) -> None:
        self.longest = max(self.longest, wall_s)


def cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def base_record(v: Variant) -> dict[str, Any]:
    return dict(
        recipe=v.recipe,
        config=v.config,
        variant=v.name,
        kind=v.kind,
        baseline=v.baseline,
        settings=v.settings,
        status="ok",
        reason="",
    )


def run_variant(v: Variant, steps: tuple[int, int], s: Settings) -> dict[str, Any]:
    rec = base_record(v)
    if v.skip:
        rec.update(status="skipped", reason=v.skip)
        log(f"{v.recipe} {v.config} {v.name}: skipped ({v.skip})")
        return rec
    import transformers

    cleanup()
    base = allocated()
    if s.cuda:
        torch.cuda.reset_peak_memory_stats()
    log(f"{v.recipe} {v.config} {v.name}: building")
    t0 = time.perf_counter()
    made = trainer = None
    failure = None
    try:
        made = v.make()
        trainer, extra = made if isinstance(made, tuple) else (made, {})
        rec["extra"] = dict(extra)
        rec["build_s"] = time.perf_counter() - t0
        if v.patch is not None:
            t1 = time.perf_counter()
            report = v.patch(trainer)
            rec["patch_s"] = time.perf_counter() - t1
            rec["report"] = report.to_dict()
            log(str(report))
        clock = StepClock(s.cuda, f"{v.config} {v.name}")
        clock.install(trainer)
        if v.hooks is not None:
            v.hooks(trainer, clock)
        transformers.set_seed(0)
        t2 = time.perf_counter()
        trainer.train()
        rec["train_s"] = time.perf_counter() - t2
        collect(rec, trainer, clock, steps)
    except torch.OutOfMemoryError as error:
        failure = ("oom", f"{type(error).__name__}: {str(error).splitlines()[0][:240]}")
    except Exception as error:  # recorded; stock/leantrain failures make the script exit non-zero
        traceback.print_exc()
        kind = "oom" if "out of memory" in str(error).lower() else "failed"
        failure = (kind, f"{type(error).__name__}: {error}"[:300])
    if failure is not None:
        rec.update(status=failure[0], reason=failure[1])
    rec["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30 if s.cuda else None
    rec["base_gib"] = base / 2**30 if s.cuda else None  # held before the variant (e.g. GRPO's pristine copy)
    rec["wall_s"] = time.perf_counter() - t0
    del made, trainer
    cleanup()
    leak = (allocated() - base) / 2**30
    if leak > 0.5:
        log(f"warning: {leak:.1f} GiB still allocated after {v.name}")
    if rec["status"] == "ok":
        sm = summary(rec)
        log(
            f"{v.recipe} {v.config} {v.name}: {sm['p50']:.0f} ms/step, {sm['tokens_per_s']:.0f} tokens/s, peak "
            f"{_gib(rec['peak_gib'])} GiB, final loss {rec['final_loss']:.5g}, wall {rec['wall_s']:.0f} s"
        )
    else:
        log(f"{v.recipe} {v.config} {v.name}: {rec['status']} ({rec['reason']})")
    return rec


def collect(rec: dict[str, Any], trainer: Any, clock: StepClock, steps: tuple[int, int]) -> None:
    warmup, timed = steps
    history = trainer.state.log_history
    losses = {e["step"]: e["loss"] for e in history if "loss" in e and "step" in e}
    for i, st in enumerate(clock.steps):
        st["warmup"] = i < warmup
        st["loss"] = losses.get(st["step"])
    if len(clock.steps) != warmup + timed:
        raise RuntimeError(f"expected {warmup + timed} steps, the clock saw {len(clock.steps)}")
    rec["steps"] = clock.steps
    rec["warmup"] = warmup
    rec["losses"] = [st["loss"] for st in clock.steps]
    rec["final_loss"] = rec["losses"][-1]
    metrics = {k: [e[k] for e in history if k in e] for k in LOG_KEYS}
    rec["metrics"] = {k: v for k, v in metrics.items() if v}


def run_group(
    variants: Sequence[Variant], steps: tuple[int, int], s: Settings, budget: Budget, prime: bool = False
) -> list[dict]:
    """Run variants that are compared with each other, or skip all of them when the budget cannot hold the group.

    ``prime`` first runs every variant once untimed on the same steps and data, and discards it: compile and
    specialization caches (TRL's Triton kernels and torch.compile'd chunks, leantrain's kernels, cuBLAS heuristics,
    and on the H100 SDPA's default attention backend: 0.1-2.7 s the first time a padded sequence length appears,
    measured by benchmarks/sdpa_shape_warmup.py) fill per process and per shape, and without a priming round over
    all the steps whichever variant first meets a length pays for it (a 2-step priming left steps 3-6 to it)."""
    if not budget.allows(len(variants) * (2 if prime else 1)):
        reason = f"recipe time budget ({budget.seconds:.0f} s) would be exceeded"
        return [run_variant(Variant(**{**v.__dict__, "skip": reason}), steps, s) for v in variants]
    if prime:  # every step: each new padded length costs a one-time warm-up (SDPA's plans; see the docstring)
        for v in variants:
            log(f"{v.recipe} {v.config} {v.name}: priming round (untimed, discarded)")
            budget.record(run_variant(v, steps, s).get("wall_s", 0.0))
    records = []
    for v in variants:
        rec = run_variant(v, steps, s)
        budget.record(rec.get("wall_s", 0.0))
        records.append(rec)
    return records


# -- shared builders -----------------------------------------------------------------------------------------------


def checkpointing(on: bool) -> dict[str, bool]:
    """Activation checkpointing on/off under its current name (transformers 5.23 deprecates gradient_checkpointing;
    TRL's configs default it to True)."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": on}


def trainer_args(out: Path, steps: int, s: Settings) -> dict[str, Any]:
    return dict(
        output_dir=str(out),
        max_steps=steps,
        bf16=s.cuda,
        use_cpu=not s.cuda,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )


def dense_model(kind: str, fields: dict, s: Settings, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A seeded random-init causal LM built directly on the device (sdpa on CUDA, eager on CPU)."""
    import transformers

    config = getattr(transformers, kind)(**fields, **TOKENS)
    torch.manual_seed(0)
    with torch.device(s.device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype or s.dtype, attn_implementation="sdpa" if s.cuda else "eager"
        )
    return model.train()


def token_dataset(vocab: int, rows: int, seq: int, seed: int = 1):
    """Pre-tokenized full-length rows of random ids (SFTTrainer skips tokenization; every token is a label)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"input_ids": torch.randint(3, vocab, (rows, seq), generator=g).tolist()})


def tokenizer():
    from leantrain.tiny import train_tokenizer

    return train_tokenizer()


def sft_trainer(model, data, out: Path, steps: int, s: Settings, **config) -> Any:
    from trl import SFTConfig, SFTTrainer

    peft_config = config.pop("peft_config", None)
    args = SFTConfig(**trainer_args(out, steps, s), dataset_num_proc=None, **config)
    return SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer(), peft_config=peft_config
    )


def leantrain_patch(**options: Any) -> Callable[[Any], Any]:
    def patch(trainer: Any) -> Any:
        import leantrain

        return leantrain.patch_trainer(trainer, **{**ONLY, **options})

    return patch


def short_shape(shape: str) -> str:
    return shape.replace("qwen2.5-", "")


# -- recipes -------------------------------------------------------------------------------------------------------


def completion_stats(clock: StepClock) -> Callable[[Any, tuple], None]:
    """Record what ``_generate`` produced: token counts and a hash of the completion ids (same completions?)."""

    def after(result: Any, args: tuple) -> None:
        prompt_ids, completion_ids = result[0], result[1]
        ids = [[int(t) for t in c] for c in completion_ids]
        clock.tokens += sum(map(len, prompt_ids)) + sum(map(len, ids))
        clock.extra["completion_tokens"] = sum(map(len, ids))
        clock.extra["completion_lengths"] = [len(c) for c in ids]
        clock.extra["completion_hash"] = hashlib.sha256(repr(ids).encode()).hexdigest()[:16]

    return after


def grpo_hooks(trainer: Any, clock: StepClock) -> None:
    clock.wrap(trainer, "_generate", "generation", after=completion_stats(clock))
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", "logps", when=lambda: not torch.is_grad_enabled())


def recipe_grpo(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from leantrain.demo import letter_reward
    from leantrain.tiny import corpus_texts

    tok = tokenizer()
    tok.padding_side = "left"
    warmup, timed = s.grpo_steps
    texts = corpus_texts()
    prompts = Dataset.from_dict({"prompt": [" ".join(t.split()[:16]) for t in texts[:64]]})
    tmp = Path(tempfile.mkdtemp(prefix="recipes_grpo_"))
    records: list[dict] = []
    try:
        for shape, fields in selected(s.grpo_shapes, args.shapes).items():
            t0 = time.perf_counter()
            pristine = dense_model("Qwen2Config", fields, s)
            path = tmp / shape
            pristine.save_pretrained(path)  # TRL builds the reference model from the policy's path when beta > 0
            pristine.config._name_or_path = str(path)
            log(f"grpo {shape}: built and saved in {time.perf_counter() - t0:.1f} s")
            for i, beta in enumerate(args.betas or s.grpo_betas):
                config = f"{short_shape(shape)} beta={beta:g}"
                settings = dict(
                    shape=shape,
                    batch=s.grpo_batch,
                    generations=s.grpo_generations,
                    completion_length=s.grpo_completion,
                    beta=beta,
                    lr=1e-6,
                    checkpointing=s.cuda,
                )

                def make(beta=beta) -> Any:
                    grpo_args = GRPOConfig(
                        **trainer_args(tmp / "out", warmup + timed, s),
                        per_device_train_batch_size=s.grpo_batch,
                        num_generations=s.grpo_generations,
                        max_completion_length=s.grpo_completion,
                        beta=beta,
                        learning_rate=1e-6,
                        **checkpointing(s.cuda),  # TRL's default (on); off for the CPU smoke run
                    )
                    return GRPOTrainer(
                        model=copy.deepcopy(pristine),
                        reward_funcs=letter_reward,
                        args=grpo_args,
                        train_dataset=prompts,
                        processing_class=tok,
                    )

                stock = Variant("grpo", config, "stock", "stock", None, make, None, grpo_hooks, settings)
                patched = Variant(
                    "grpo",
                    config,
                    "leantrain",
                    "leantrain",
                    "stock",
                    make,
                    leantrain_patch(grpo_logps=True),
                    grpo_hooks,
                    settings,
                )
                # alternate (drift shows as noise); --reverse swaps, to repeat a pair in the other order
                order = [stock, patched] if (i + args.reverse) % 2 == 0 else [patched, stock]
                # the first config of a shape primes the kernels of both variants (beta > 0 runs every one of them)
                records += run_group(filtered(order, args.only), s.grpo_steps, s, budget, prime=i == 0)
            pristine = None
            cleanup()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records


def recipe_sft(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    warmup, timed = s.sft_steps
    records: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="recipes_sft_"))
    try:
        for shape, fields in selected(s.sft_shapes, args.shapes).items():
            pristine = dense_model("Qwen2Config", fields, s)
            data = token_dataset(fields["vocab_size"], (warmup + timed) * s.sft_batch, s.sft_seq)
            config = f"{short_shape(shape)} {s.sft_batch}x{s.sft_seq}"
            settings = dict(shape=shape, batch=s.sft_batch, seq=s.sft_seq, lr=1e-5, checkpointing=s.cuda)

            def make() -> Any:
                return sft_trainer(
                    copy.deepcopy(pristine),
                    data,
                    tmp,
                    warmup + timed,
                    s,
                    learning_rate=1e-5,
                    per_device_train_batch_size=s.sft_batch,
                    max_length=s.sft_seq,
                    **checkpointing(s.cuda),
                )

            group = [Variant("sft", config, "stock", "stock", None, make, settings=settings)]
            for ratio in s.sft_ratios:
                patch = leantrain_patch(cggr=True, cggr_min_tokens_ratio=ratio, cggr_warmup_steps=0)
                group.append(
                    Variant(
                        "sft",
                        config,
                        f"leantrain cggr {ratio:g}",
                        "leantrain",
                        "stock",
                        make,
                        patch,
                        settings={**settings, "cggr_ratio": ratio},
                    )
                )
            records += run_group(filtered(group, args.only), s.sft_steps, s, budget)
            pristine = None
            cleanup()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def init_parameter(name: str, param: torch.Tensor, std: float) -> None:
    """Seeded by the parameter's name, so every layout / build order gets the same weights."""
    g = torch.Generator(device=param.device).manual_seed(zlib.crc32(name.encode()))
    with torch.no_grad():
        owner = name.rsplit(".", 2)[-2] if name.count(".") else ""
        if owner.endswith("norm"):
            param.fill_(1.0)
        elif param.dim() >= 2 or name.endswith(("sinks", "router.bias")):
            param.normal_(0.0, std, generator=g)
        else:
            param.zero_()


def build_gpt_oss(fields: dict, layout: str, s: Settings) -> tuple[torch.nn.Module, dict[str, Any]]:
    """gpt-oss on the meta device, then one decoder layer at a time on the device with its experts quantized right
    away (``stacked``: quantize_experts_4bit; ``linear4bit``: per-expert bnb Linear4bit lists; ``bf16``: as is)."""
    import transformers
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

    from leantrain import quantize_experts_4bit
    from tests._moe4bit_models import linear4bit_experts_from

    t0 = time.perf_counter()
    config = transformers.GptOssConfig(**fields, **TOKENS)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=s.dtype)
    config = model.config  # attention / experts implementations resolved by from_config
    std = config.initializer_range
    for i in range(config.num_hidden_layers):
        with torch.device(s.device), default_dtype(s.dtype):
            layer = gpt_oss.GptOssDecoderLayer(config, i)
        for name, param in layer.named_parameters():
            init_parameter(f"model.layers.{i}.{name}", param, std)
        if layout == "stacked":
            quantize_experts_4bit(layer)
        elif layout == "linear4bit":
            layer.mlp.experts = linear4bit_experts_from(layer.mlp.experts)
        model.model.layers[i] = layer
        del layer
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, child = name.rpartition(".")
            with torch.device(s.device):  # inv_freq is computed in __init__: build it again on the device
                setattr(model.get_submodule(parent), child, type(module)(config=config))
    for name, module in model.named_modules():
        meta = [n for n, p in module.named_parameters(recurse=False) if p.is_meta]
        if meta:
            module.to_empty(device=s.device, recurse=False)
            for n in meta:
                init_parameter(f"{name}.{n}", getattr(module, n), std)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device: {left[:5]}")
    if s.cuda:
        torch.cuda.synchronize()
    info = {
        "build_model_s": time.perf_counter() - t0,
        "model_gib": allocated() / 2**30 if s.cuda else None,
        "layout": layout,
        "experts_implementation": config._experts_implementation,
        "attention": config._attn_implementation,
    }
    return model.train(), info


MOE_VARIANTS = (  # name, kind, baseline, layout, patched
    ("leantrain grouped (stacked)", "leantrain", "stock stacked 4-bit", "stacked", True),
    ("stock stacked 4-bit", "stock", None, "stacked", False),
    ("leantrain grouped (Linear4bit)", "leantrain", "stock Linear4bit loop", "linear4bit", True),
    ("stock Linear4bit loop", "stock", None, "linear4bit", False),
    ("stock bf16 experts", "reference", None, "bf16", False),
)


def recipe_moe_qlora(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    from peft import LoraConfig

    warmup, timed = s.moe_steps
    fields = s.moe_shape
    data = token_dataset(fields["vocab_size"], (warmup + timed) * s.moe_batch, s.moe_seq)
    tmp = Path(tempfile.mkdtemp(prefix="recipes_moe_"))
    config = (
        f"gpt-oss {fields['num_hidden_layers']}L {fields['num_local_experts']}E top-"
        f"{fields['num_experts_per_tok']} {s.moe_batch}x{s.moe_seq}"
    )
    variants = []
    for name, kind, baseline, layout, patched in MOE_VARIANTS:
        settings = dict(
            fields,
            batch=s.moe_batch,
            seq=s.moe_seq,
            lora_r=s.lora_r,
            lora_targets="q,k,v,o_proj",
            layout=layout,
            lr=2e-4,
            checkpointing=s.cuda,
        )

        def make(layout=layout) -> tuple[Any, dict]:
            import transformers

            model, info = build_gpt_oss(fields, layout, s)
            log(f"  built gpt-oss ({layout}) in {info['build_model_s']:.1f} s: {_gib(info['model_gib'])} GiB")
            transformers.set_seed(0)  # LoRA init
            lora = LoraConfig(
                r=s.lora_r,
                lora_alpha=2 * s.lora_r,
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            )
            trainer = sft_trainer(
                model,
                data,
                tmp,
                warmup + timed,
                s,
                peft_config=lora,
                learning_rate=2e-4,
                per_device_train_batch_size=s.moe_batch,
                max_length=s.moe_seq,
                **checkpointing(s.cuda),
            )
            return trainer, info

        patch = leantrain_patch(moe4bit=True) if patched else None
        variants.append(Variant("moe_qlora", config, name, kind, baseline, make, patch, settings=settings))
    records: list[dict] = []
    try:
        for v in filtered(variants, args.only):
            records += run_group([v], s.moe_steps, s, budget)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records


def recipe_osft(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    from bench_osft import load_mini_trainer, mini_trainer_model
    from transformers import TrainerCallback

    from leantrain.osft import osft_layers

    warmup, timed = s.osft_steps
    fields = s.osft_shape
    base = dense_model("LlamaConfig", fields, s, dtype=torch.float32)  # fp32 master weights, bf16 autocast
    data = token_dataset(fields["vocab_size"], (warmup + timed) * s.osft_batch, s.osft_seq)
    mt, mt_reason = load_mini_trainer()
    log(f"mini_trainer: {mt_reason if mt is not None else 'unavailable: ' + mt_reason}")
    tmp = Path(tempfile.mkdtemp(prefix="recipes_osft_"))
    config = f"{s.osft_name} {s.osft_batch}x{s.osft_seq}"
    settings = dict(
        shape=s.osft_name,
        batch=s.osft_batch,
        seq=s.osft_seq,
        lr=1e-5,
        unfrozen_rank_ratio=0.5,
        weights="fp32, bf16 autocast",
        checkpointing=False,
    )
    factors: dict[str, Any] = {}  # leantrain's initial factors (CPU copies) for mini_trainer: no second SVD

    def trainer_for(model) -> Any:
        return sft_trainer(
            model,
            data,
            tmp,
            warmup + timed,
            s,
            learning_rate=1e-5,
            max_length=s.osft_seq,
            per_device_train_batch_size=s.osft_batch,
            **checkpointing(False),
        )

    def patch_osft(trainer: Any) -> Any:
        report = leantrain_patch(osft=True)(trainer)
        factors.update({n: copy.deepcopy(layer).cpu() for n, layer in osft_layers(trainer.model).items()})
        return report

    class Projections(TrainerCallback):  # mini_trainer's own calls around optimizer.step()
        def __init__(self, model) -> None:
            self.model = model

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.model.project_gradients()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.model.project_parameters()

    def make_mt() -> Any:
        if not factors:
            raise RuntimeError("leantrain's OSFT variant did not run, so there are no factors to start from")
        model = mini_trainer_model(mt, base, factors).train()
        model.upcast_dtype = torch.float32
        return trainer_for(model)

    def mt_hooks(trainer: Any, clock: StepClock) -> None:
        trainer.callback_handler.callbacks.insert(-1, Projections(trainer.model))  # inside the optimizer timer

    variants = [
        Variant(
            "osft", config, "dense full FT", "stock", None, lambda: trainer_for(copy.deepcopy(base)), settings=settings
        ),
        Variant(
            "osft",
            config,
            "leantrain osft",
            "leantrain",
            "dense full FT",
            lambda: trainer_for(copy.deepcopy(base)),
            patch_osft,
            settings=settings,
        ),
        Variant(
            "osft",
            config,
            "mini_trainer 0.9.0 osft",
            "peer",
            "dense full FT",
            make_mt,
            None,
            mt_hooks,
            settings=settings,
            skip=None if mt is not None else f"mini_trainer: {mt_reason}",
        ),
    ]
    try:
        return run_group(filtered(variants, args.only), s.osft_steps, s, budget)
    finally:
        factors.clear()
        base = None
        cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


RECIPE_FNS = {"grpo": recipe_grpo, "sft": recipe_sft, "moe_qlora": recipe_moe_qlora, "osft": recipe_osft}


def selected(shapes: dict[str, dict], wanted: str | None) -> dict[str, dict]:
    if not wanted:
        return shapes
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; choose from {list(shapes)}")
    return {n: shapes[n] for n in names}


def filtered(variants: list[Variant], only: str | None) -> list[Variant]:
    if not only:
        return variants
    keys = [k.strip() for k in only.split(",") if k.strip()]
    return [v for v in variants if any(k in v.name for k in keys)]


# -- rows, table, plot ---------------------------------------------------------------------------------------------


def summary(rec: dict[str, Any]) -> dict[str, Any]:
    timed = [st for st in rec["steps"] if not st["warmup"]]
    totals = [st["total_ms"] for st in timed]
    qs = statistics.quantiles(totals, n=10) if len(totals) >= 2 else totals * 9
    parts = {p: statistics.median(st["parts"][p] for st in timed) for p in PARTS}
    tokens = sum(st["tokens"] for st in timed)
    return dict(
        p50=statistics.median(totals),
        p20=qs[1],
        p80=qs[7],
        parts=parts,
        tokens_per_step=tokens / len(timed),
        tokens_per_s=tokens / sum(totals) * 1e3,
    )


def timed_steps(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [st for st in config.get("steps") or [] if not st["warmup"]]


def outside_generation(step: dict[str, Any]) -> float:
    return step["total_ms"] - step["parts"].get("generation", 0.0)


def without_generation(config: dict[str, Any]) -> float | None:
    """Median over the timed steps of step time minus generation (what the log-prob kernels can change), or None
    for recipes that do not generate. Generation is launch-bound decoding with a wide per-step spread (see notes)."""
    steps = timed_steps(config)
    if not steps or not any(st["parts"].get("generation", 0.0) > 0 for st in steps):
        return None
    return statistics.median(outside_generation(st) for st in steps)


def to_rows(rec: dict[str, Any]) -> list[Row]:
    ident = dict(
        recipe=rec["recipe"],
        variant=rec["variant"],
        kind=rec["kind"],
        baseline=rec["baseline"],
        settings=rec["settings"],
    )
    where = (NAME, rec["variant"], rec["recipe"])
    if rec["status"] != "ok":
        config = {**ident, **{k: rec.get(k) for k in ("peak_gib", "base_gib", "wall_s", "extra")}}
        return [Row(*where, rec["status"], rec["reason"], "config", rec["config"], 0.0, config=config)]
    sm = summary(rec)
    keep = (
        "warmup",
        "steps",
        "losses",
        "final_loss",
        "peak_gib",
        "base_gib",
        "build_s",
        "patch_s",
        "train_s",
        "wall_s",
        "extra",
        "metrics",
        "report",
    )
    config = {
        **ident,
        **{k: rec.get(k) for k in keep},
        "parts_ms": sm["parts"],
        "tokens_per_step": sm["tokens_per_step"],
        "tokens_per_s": sm["tokens_per_s"],
    }
    return [
        Row(*where, "speed", "ms/step", "config", rec["config"], sm["p50"], sm["p20"], sm["p80"], config=config),
        Row(*where, "throughput", "tokens/s", "config", rec["config"], sm["tokens_per_s"]),
        Row(*where, "memory", "GiB peak above start", "config", rec["config"], rec.get("peak_gib") or float("nan")),
        Row(*where, "quality", "final loss", "config", rec["config"], rec["final_loss"]),
    ]


def main_rows(rows: Sequence[Row]) -> list[Row]:
    """One row per variant: the speed row, or the status row (oom / skipped / failed)."""
    return [r for r in rows if r.benchmark == NAME and r.metric not in ("throughput", "memory", "quality")]


def ms(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def split_text(parts: dict[str, float], total: float) -> str:
    return ", ".join(f"{SHORT[p]} {ms(v)}" for p, v in parts.items() if abs(v) >= 0.005 * total)


def find(rows: Sequence[Row], recipe: str, config: Any, variant: str | None) -> Row | None:
    return next((r for r in rows if r.mode == recipe and r.x_value == config and r.provider == variant), None)


def table(rows: Sequence[Row]) -> str:
    main = main_rows(rows)
    devices = sorted({r.device for r in main})
    header = [
        "recipe",
        "config",
        "variant",
        "step ms (p50)",
        "split ms (p50)",
        "tokens/s",
        "peak GiB",
        "final loss",
        "vs stock",
    ]
    generating = any(r.metric == "speed" and without_generation(r.config) is not None for r in main)
    header += ["without generation ms (p50), vs stock"] if generating else []
    header += ["device"] if len(devices) > 1 else []
    body = []
    for r in main:
        c = r.config
        if r.metric != "speed":
            cells = [r.mode, r.x_value, r.provider, r.metric, r.unit, "", _gib(c.get("peak_gib")), "", ""]
            cells += [""] if generating else []
        else:
            base = find(main, r.mode, r.x_value, c.get("baseline"))
            ratio = (
                "1"
                if c.get("baseline") is None
                else (f"{base.p50 / r.p50:.3f}x" if base is not None and base.metric == "speed" else "n/a")
            )
            loss = c.get("final_loss")
            cells = [
                r.mode,
                r.x_value,
                r.provider,
                ms(r.p50),
                split_text(c["parts_ms"], r.p50),
                f"{c['tokens_per_s']:.0f}",
                _gib(c.get("peak_gib")),
                "n/a" if loss is None else f"{loss:.5g}",
                ratio,
            ]
            if generating:
                cells.append(_without_generation_cell(r, base))
        body.append(cells + ([r.device] if len(devices) > 1 else []))
    return markdown_table(header, body)


def _without_generation_cell(r: Row, base: Row | None) -> str:
    mine = without_generation(r.config)
    if mine is None:
        return ""
    theirs = without_generation(base.config) if base is not None and base.metric == "speed" else None
    if r.config.get("baseline") is None:
        return f"{ms(mine)} (1)"
    return f"{ms(mine)} ({theirs / mine:.2f}x)" if theirs is not None else f"{ms(mine)} (n/a)"


def _gib(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


def differences(rows: Sequence[Row], threshold: float = 0.02) -> list[str]:
    """Every leantrain / peer variant against its baseline: the step change, each part whose change exceeds
    ``threshold`` of the baseline step, the losses, and for GRPO whether the completions were the same."""
    main = main_rows(rows)
    lines = []
    for r in main:
        c = r.config
        base = find(main, r.mode, r.x_value, c.get("baseline")) if c.get("baseline") else None
        if r.metric != "speed" or base is None or base.metric != "speed":
            continue
        b = base.config
        change = r.p50 / base.p50 - 1
        flag = "" if abs(change) <= threshold else " (above 2%)"
        parts = [
            f"{p} {ms(b['parts_ms'][p])} -> {ms(c['parts_ms'][p])} ms"
            f" ({(c['parts_ms'][p] - b['parts_ms'][p]) / base.p50:+.1%} of the step)"
            for p in PARTS
            if abs(c["parts_ms"][p] - b["parts_ms"][p]) > threshold * base.p50
        ]
        text = (
            f"- {r.mode} {r.x_value}, {r.provider} vs {base.provider}: {ms(base.p50)} -> {ms(r.p50)} ms/step "
            f"({change:+.1%}){flag}"
        )
        text += "; " + "; ".join(parts) if parts else "; no part moved by more than 2% of the step"
        mine, theirs = without_generation(c), without_generation(b)
        if mine is not None and theirs is not None:
            text += f"; without generation {ms(theirs)} -> {ms(mine)} ms ({theirs / mine:.2f}x)"
        text += f"; final loss {b.get('final_loss'):.5g} -> {c.get('final_loss'):.5g}"
        same = completions_match(base, r)
        if same:
            text += f"; {same}"
        lines.append(text)
    return lines


def completions_match(a: Row, b: Row) -> str:
    """GRPO: which steps produced identical completions (hash of the token ids) and equal token counts."""
    steps_a, steps_b = a.config.get("steps") or [], b.config.get("steps") or []
    pairs = [(x, y) for x, y in zip(steps_a, steps_b) if "completion_hash" in x and "completion_hash" in y]
    if not pairs:
        return ""
    same = sum(x["completion_hash"] == y["completion_hash"] for x, y in pairs)
    lengths = sum(x["completion_tokens"] == y["completion_tokens"] for x, y in pairs)
    tokens = "/".join(str(x["completion_tokens"]) for x, _ in pairs)
    return (
        f"completions identical in {same}/{len(pairs)} steps, equal completion tokens in {lengths}/"
        f"{len(pairs)} (stock per step: {tokens})"
    )


def warmup_spikes(config: dict[str, Any], factor: float = 3.0) -> list[str]:
    """Timed steps whose time outside generation exceeds ``factor`` x the variant's median: a one-time warm-up
    (a new sequence length, a recompile) that the priming round did not absorb; the medians include it."""
    steps = timed_steps(config)
    rest = [outside_generation(st) for st in steps]
    if len(rest) < 3:
        return []
    typical = statistics.median(rest)
    return [
        f"step {st['step']} took {ms(r)} ms outside generation ({r / typical:.1f}x the median: a one-time warm-up)"
        for st, r in zip(steps, rest)
        if r > factor * typical
    ]


def notes(rows: Sequence[Row]) -> list[str]:
    out = []
    for r in main_rows(rows):
        c = r.config
        extra, metrics = c.get("extra") or {}, c.get("metrics") or {}
        bits = []
        if "build_model_s" in extra:
            bits.append(
                f"model build {extra['build_model_s']:.1f} s ({extra['layout']}, "
                f"{_gib(extra['model_gib'])} GiB, experts {extra['experts_implementation']})"
            )
        if c.get("patch_s") is not None:
            bits.append(f"patch_trainer {c['patch_s']:.1f} s")
        bits += warmup_spikes(c)
        gen = [st["parts"].get("generation", 0.0) / 1e3 for st in timed_steps(c)]
        if any(gen):
            bits.append(f"generation per timed step {min(gen):.1f}-{max(gen):.1f} s")
        if "cggr/kept_fraction" in metrics:
            kept = metrics["cggr/kept_fraction"]
            bits.append(f"CGGR kept fraction {min(kept):.3f}-{max(kept):.3f}")
        report = c.get("report")
        if report:
            applied = [o["name"] for o in report["outcomes"] if o["status"] == "applied"]
            bits.append(f"applied: {', '.join(applied) or 'nothing'}")
        if bits:
            out.append(f"- {r.mode} {r.x_value}, {r.provider}: " + "; ".join(bits))
    return out


def markdown(rows: Sequence[Row]) -> str:
    text = (
        "What `patch_trainer` changes in a training step, measured: random-init public shapes (real vocab sizes), "
        "stock and leantrain in one process, seeded, medians over the timed steps after warm-up. Split: exclusive "
        "time in the trainer's own methods (see benchmarks/bench_recipes.py); peak = CUDA memory allocated above "
        "what was allocated before the variant was built; vs stock = baseline step time / this step time.\n\n"
        + table(rows)
    )
    diffs, extra = differences(rows), notes(rows)
    if diffs:
        text += "\n\nDifferences (parts that moved by more than 2% of the baseline step):\n\n" + "\n".join(diffs)
    if extra:
        text += "\n\nNotes:\n\n" + "\n".join(extra)
    return text


def plot(rows: Sequence[Row], path: Path) -> None:
    """One panel per recipe (the config in its title when it has one), a bar per variant, the split stacked."""
    main = main_rows(rows)
    panels: dict[str, dict[str, dict[str, float]]] = {}
    for recipe in dict.fromkeys(r.mode for r in main):
        mine = [r for r in main if r.mode == recipe]
        configs = list(dict.fromkeys(r.x_value for r in mine))
        title = f"{recipe}: {configs[0]}" if len(configs) == 1 else recipe
        bars = panels.setdefault(title, {})
        for r in mine:
            label = r.provider if len(configs) == 1 else f"{r.x_value} | {r.provider}"
            label += "" if r.metric == "speed" else f" ({r.metric})"
            values = r.config["parts_ms"] if r.metric == "speed" else {}
            bars[label] = {p: max(0.0, v) / 1e3 for p, v in values.items()}
            if values.get("generation", 0.0) > 0:  # generation hides the rest: the same bars again without it
                rest = panels.setdefault(f"{recipe}: without generation", {})
                rest[label] = {p: max(0.0, v) / 1e3 for p, v in values.items() if p != "generation"}
    title = "Training step time per recipe, stock vs leantrain (s, lower is better)"
    stacked_bar_panels(path, title, panels, PARTS, "s / step")


def write_all(rows: list[Row], out_dir: Path) -> None:
    order = {name: i for i, name in enumerate(RECIPES)}
    rows = sorted(rows, key=lambda r: order.get(r.mode, len(order)))  # stable: run order kept within a recipe
    write_results(NAME, rows, markdown(rows), out_dir)
    plot(rows, out_dir / f"{NAME}.png")
    log(f"wrote {out_dir / NAME}.json/.md/.png ({len(main_rows(rows))} variants)")


def merge(old: Sequence[Row], new: Sequence[Row]) -> list[Row]:
    """Old rows of the (recipe, config) pairs not in ``new``, then ``new`` (a run of one grpo shape keeps the
    other shape's rows)."""
    ran = {(r.mode, r.x_value) for r in new}
    return [r for r in old if (r.mode, r.x_value) not in ran] + list(new)


# -- main ----------------------------------------------------------------------------------------------------------


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Defaults from the environment too, so `BENCH_RECIPE=grpo bash benchmarks/gpu_run.sh recipes` picks one.
    env = os.environ.get
    parser.add_argument("--recipe", default=env("BENCH_RECIPE", "all"), choices=(*RECIPES, "all"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, every recipe (< 60 s)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="with --smoke: run the tiny shapes here (cuda: check the CUDA paths)"
    )
    parser.add_argument("--shapes", default=env("BENCH_RECIPE_SHAPES"), help="comma-separated grpo / sft shapes")
    parser.add_argument(
        "--only",
        default=env("BENCH_RECIPE_ONLY"),
        help="run only variants whose name has one of these comma-separated substrings",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=env("BENCH_RECIPE_BUDGET_S"),
        help="per-recipe time budget (default 450 s on CUDA)",
    )
    parser.add_argument("--betas", type=_floats, default=None, help="grpo: comma-separated betas (default 0.04,0)")
    parser.add_argument("--reverse", action="store_true", help="grpo: each pair in the other order (leantrain first)")
    parser.add_argument("--merge", nargs="+", type=Path, help="only merge these recipes.json files and redraw")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    default_out = Path(tempfile.gettempdir()) / "leantrain_recipes_smoke" if args.smoke else RESULTS
    out_dir = Path(os.environ.get("BENCH_RESULTS", default_out))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.merge:
        rows: list[Row] = []
        for path in args.merge:
            rows = merge(rows, read_rows(path))
        write_all(rows, out_dir)
        return 0
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("the recipes need CUDA; use --smoke on CPU")
    s = SMOKE if args.smoke else FULL
    if args.device is not None:
        if not args.smoke:
            raise SystemExit("--device goes with --smoke (the full recipes run on CUDA)")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: this machine has no CUDA device")
        s = Settings(**{**s.__dict__, "device": args.device})
    if args.budget_s is not None:
        s = Settings(**{**s.__dict__, "budget_s": args.budget_s})
    if not s.cuda:
        torch.set_num_threads(1)  # tiny CPU shapes: a second thread only adds contention (and spin-waits)
    _quiet()
    recipes = RECIPES if args.recipe == "all" else (args.recipe,)
    records: list[dict] = []
    for recipe in recipes:
        t0 = time.perf_counter()
        log(f"=== {recipe}")
        records += RECIPE_FNS[recipe](s, Budget(s.budget_s), args)
        log(f"=== {recipe} done in {time.perf_counter() - t0:.0f} s")
    new = [row for rec in records for row in to_rows(rec)]
    existing = out_dir / f"{NAME}.json"
    if not existing.exists() and not args.smoke:
        existing = RESULTS / f"{NAME}.json"
    rows = merge(read_rows(existing), new)
    write_all(rows, out_dir)
    print(markdown([r for r in rows if r.mode in recipes]), flush=True)
    failed = [r for r in records if r["status"] == "failed" and r["kind"] in ("stock", "leantrain")]
    return 1 if failed else 0


def _quiet() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()


if __name__ == "__main__":
    raise SystemExit(main())
