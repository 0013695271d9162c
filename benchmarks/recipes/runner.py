"""Shared runner of the recipes: the per-step clock, variants, the time budget, running a group of variants
and the trainer-building helpers every recipe uses."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import statistics
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from leantrain.config import OPTIMIZATIONS

from .settings import Settings


NAME = "recipes"
RECIPES = (
    "grpo",
    "grpo_lora",
    "sft",
    "dense_sft",
    "moe_qlora",
    "moe_qlora_experts",
    "osft",
)  # run order of --recipe all, table order
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
TOKENS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)  # leantrain.cli.tiny's tokenizer


# Every optimization explicitly off (the option table's names): a variant turns exactly one on.
ONLY = dict.fromkeys(OPTIMIZATIONS, False)
LOG_KEYS = ("cggr/kept_fraction", "cggr/score_ms", "completions/mean_length", "reward", "kl", "entropy", "grad_norm")
START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.0f} s, cpu {time.process_time():5.0f} s] {message}", flush=True)


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


class NotMeasured(Exception):
    """Raised by a variant's ``make`` when what it built is not what it is named for (e.g. no LoRA adapters on the
    experts): recorded as status "not measured" with this reason instead of timing something else."""


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
    except NotMeasured as error:  # the variant would time something else than it claims: say why, time nothing
        failure = ("not measured", str(error)[:300])
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
            f"{gib(rec['peak_gib'])} GiB, final loss {rec['final_loss']:.5g}, wall {rec['wall_s']:.0f} s"
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
    benchmarks/results/sdpa_shape_warmup.md) fill per process and per shape, and without a priming round over
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


def run_both_orders(
    pair: Sequence[Variant], steps: tuple[int, int], s: Settings, budget: Budget, prime: bool, orders: int = 2
) -> list[dict]:
    """A stock / leantrain pair timed fairly: the priming round (``prime``), the pair in the given order, then (with
    ``orders=2``) in the other order, each variant's two runs merged into one record whose medians run over the
    timed steps of both orders. Whichever variant runs first in a process may still meet a first-time cost the
    priming missed (SDPA's per-length plans, allocator growth): both orders give it to each variant once.

    The second order is skipped, and the records say so, when the budget cannot hold it."""
    first = run_group(pair, steps, s, budget, prime=prime)
    if all(r["status"] == "skipped" for r in first):  # the budget: nothing was timed
        return first
    names = [v.name for v in pair]
    if orders < 2 or any(r["status"] != "ok" for r in first):
        why = "" if orders < 2 else ", a variant did not finish so no second order"
        return [dict(r, timing=timing(prime, names, why)) for r in first]
    second = {r["variant"]: r for r in run_group(pair[::-1], steps, s, budget)}
    if any(r["status"] == "skipped" for r in second.values()):
        why = f", the other skipped: {next(iter(second.values()))['reason']}"
        return [dict(r, timing=timing(prime, names, why)) for r in first]
    return [merge_orders([r, second[r["variant"]]], timing(prime, names, both=True)) for r in first]


def timing(prime: bool, names: Sequence[str], why: str = "", both: bool = False) -> str:
    """How a pair was timed, for the table: primed or not, one order (which) or both (medians over both)."""
    if both:
        text = f"both orders, medians over both ({names[0]} first, then {names[-1]} first)"
    else:
        text = f"one order ({', then '.join(names)}{why})"
    return ("primed, " if prime else "") + text


def merge_orders(recs: Sequence[dict], timing_text: str) -> dict:
    """One record of a variant from its runs in both orders: the steps of each (tagged with ``order``), the
    highest peak, summed wall times; a run that failed is returned as the record (its failure is the result)."""
    failed = [r for r in recs if r["status"] != "ok"]
    if failed:
        return dict(failed[0], timing=timing_text)
    merged = dict(recs[0], timing=timing_text)
    merged["steps"] = [dict(st, order=k) for k, rec in enumerate(recs) for st in rec["steps"]]
    merged["losses"] = [loss for rec in recs for loss in rec["losses"]]
    merged["final_loss"] = recs[0]["final_loss"]  # the first order's (same data and seed in both)
    merged["metrics"] = {k: [v for rec in recs for v in rec["metrics"].get(k, [])] for k in recs[0]["metrics"]}
    for key in ("peak_gib", "base_gib"):
        values = [rec[key] for rec in recs if rec.get(key) is not None]
        merged[key] = max(values) if values else None
    for key in ("build_s", "train_s", "wall_s"):
        merged[key] = sum(rec.get(key) or 0.0 for rec in recs)
    return merged


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


def gib(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


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
    from leantrain.cli.tiny import train_tokenizer

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
