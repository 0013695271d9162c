"""Offloaded activation checkpoints (``offload_checkpoints``) on one CUDA GPU: what a training step costs and what
peak GPU memory it saves against stock checkpointing, transformers' own offload, ``patch_trainer`` without it and
Unsloth's offloaded checkpointing; and (``--longest``) the longest sequence each trains under a memory cap.

Step mode (the default): TRL's ``SFTTrainer`` (a transformers Trainer) on seeded random-init public shapes with their
real vocabularies (saved once per shape, loaded by every variant: the same weights everywhere), LoRA r16 alpha 32 on
all 7 projections (head frozen), bf16, activation checkpointing, AdamW, lr 2e-4, fixed 4 x 2048 tokens, 3 warm-up
then 8 timed steps of a run told 1000 steps (auto mode decides as it would for a user's run). Cases:
``llama-3.2-1b``, ``llama-3.2-1b-qlora`` (nf4 double-quant base, bf16 compute; a row saying skipped without
bitsandbytes) and ``qwen2.5-1.5b``. Variants, each in its own Python process:
  stock              the trainer as built (stock checkpointing)
  hf_offload         transformers' own offload: activation_checkpointing_kwargs={"use_reentrant": False,
                     "offload": True} (copies on the compute stream); a row saying skipped where transformers lacks it
  leantrain          patch_trainer(trainer, offload_checkpoints=False): every other default
  leantrain_offload  patch_trainer(trainer, offload_checkpoints=True)
  unsloth            FastLanguageModel + get_peft_model(use_gradient_checkpointing="unsloth"), its own offloaded
                     checkpointing; a row saying not installed where unsloth does not import
Every case runs twice in alternating order (A B A B: the shared GPU drifts by up to 15% over minutes). Recorded per
variant: the median step and p20/p80 over both runs' timed steps and each run's own median, the first step, peak
allocated and peak reserved GPU memory over training (torch.cuda.max_memory_allocated/reserved, weights included),
the losses (agreement with stock over the first steps; leantrain_offload against leantrain over every step, where it
must be exact) and, for leantrain_offload, leantrain.offload_checkpoints.stats(trainer). The table states the step
cost of the offload against ``leantrain`` (target: at most 3%), the memory it saves, and the ratios to Unsloth.

``--longest``: for stock, leantrain, leantrain_offload and unsloth on ``llama-3.2-1b`` and ``llama-3.2-1b-qlora``,
the longest sequence (a multiple of 256 in [1024, 131072]) that trains 2 steps at batch 1 under a memory cap
(``torch.cuda.set_per_process_memory_fraction(cap / total)``, ``--cap-gib``, default 24), found by bisection; each
probe in its own process (an OOM leaves nothing behind), an OOM, a crash, a timeout or a leantrain fallback counts as
"does not fit". Recorded: the longest length, the step time and peak memory at it, every probe.

Rows (with device, versions, date, commit) go to offload_checkpoints.json / .md / .png in ``--out``, else
$BENCH_RESULTS, else benchmarks/results/, rewritten after every process: a run cut off keeps what finished. A run
replaces only its own (case, variant) rows; step and --longest rows live side by side. ``--smoke`` (a tiny model, still
CUDA: seconds of training a process) writes offload_checkpoints_smoke.* instead.

On the GPU machine, from the repo root (gpu_run.sh runs benchmarks/install_wheels.sh first, which installs PEFT, TRL
and bitsandbytes from the carried .whl* folders, and sets PYTHONPATH and $BENCH_RESULTS):
    bash benchmarks/gpu_run.sh offload_checkpoints=--smoke offload_checkpoints=--smoke,--longest  # ~2 + 3 min
    bash benchmarks/gpu_run.sh offload_checkpoints=--cases,llama-3.2-1b              # one case per device call
    bash benchmarks/gpu_run.sh offload_checkpoints=--longest,--cap-gib,24,--variants,stock,leantrain
With Unsloth's row (its stack: transformers <= 5.17, TRL 1.15; carry .whl_unsloth and a bitsandbytes bundle):
    VS_BENCH=benchmarks/bench_offload_checkpoints.py bash benchmarks/gpu_vs_unsloth.sh --cases llama-3.2-1b
    VS_BENCH=benchmarks/bench_offload_checkpoints.py bash benchmarks/gpu_vs_unsloth.sh --longest --variants unsloth
Directly (after ``bash benchmarks/install_wheels.sh`` and
``export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD:/tmp/site``):
    python benchmarks/bench_offload_checkpoints.py
    python benchmarks/bench_offload_checkpoints.py --longest --cap-gib 24
    python benchmarks/bench_offload_checkpoints.py --smoke [--longest]
    python benchmarks/bench_offload_checkpoints.py --merge call1/offload_checkpoints.json call2/... --out DIR
Subsets: ``--cases llama-3.2-1b --variants stock,leantrain_offload`` (commas or spaces); the search range:
``--low 8192 --high 65536``. ``--smoke`` runs 1 round and a 2-probe search by default: every process pays its imports
(~10 s), so a smoke run takes minutes, not seconds.
Time (H200, 2026-11-29): a step-mode process takes 26-59 s (a case with leantrain, leantrain_offload and unsloth,
twice: ~4 min); a --longest search is ~10 probes of 25-60 s per (case, variant): one or two variants per call, or,
with ``--parallel 4`` (the variants of a case search side by side, each process under its own cap; each longest
length then trains once more alone for its step time), one case per call:
    VS_BENCH=benchmarks/bench_offload_checkpoints.py bash benchmarks/gpu_vs_unsloth.sh --longest --parallel 4 \
        --cases llama-3.2-1b --variants stock,leantrain,leantrain_offload,unsloth
Unsloth imports where it is installed, or from the site folder named by
$UNSLOTH_SITE, put on the path of the unsloth process only (the layout benchmarks/gpu_vs_unsloth.sh installs into
/tmp/site_unsloth); Unsloth 2026.10.9 accepts transformers <= 5.17, so on a newer transformers its row is the
failure it raises. On a machine without CUDA the script exits with code 2 (``--help`` and ``--merge`` still work).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import bench_vs_unsloth as peer
import memory_peak
import shapes
from offload_checkpoints_tables import (  # the rows, tables, plot and lines from the records (pure: tested on CPU)
    GIB,
    NAME,
    SKIPS,
    VARIANTS,
    compact,
    latest,
    longest_line,
    longest_rows,
    now,
    plot,
    probe_line,
    step_line,
    step_rows,
    tables,
)


HERE = Path(__file__).resolve().parent
LONGEST_VARIANTS = ("stock", "leantrain", "leantrain_offload", "unsloth")
STEP_CASES = ("llama-3.2-1b", "llama-3.2-1b-qlora", "qwen2.5-1.5b")
LONGEST_CASES = ("llama-3.2-1b", "llama-3.2-1b-qlora")
HF_OFFLOAD = {"use_reentrant": False, "offload": True}  # stock's kwargs (transformers' default) plus the offload
# Smoke: big enough that a layer input (2 x 1024 x 512 x 2 bytes = 2 MiB) passes the offload's 1 MiB floor.
TINY = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=8192)  # fmt: skip
# The search range of --longest: full and smoke (low, high, step).
GRID = (1024, 131072, 256)
SMOKE_GRID = (256, 512, 256)  # two probes: the search, the cap and the probe processes run, nothing more


# -- the cases ------------------------------------------------------------------------------------------------------


def cases(smoke: bool) -> dict[str, peer.Case]:
    """Step-mode cases: 4 x 2048 tokens, 3 warm-up and 8 timed steps (smoke: 2 x 1024, 1 and 2)."""
    if smoke:
        small = dict(batch=2, seq=1024, steps=(1, 2))
        found = [peer.Case("tiny-llama", "LlamaConfig", TINY, "sdpa", **small),
                 peer.Case("tiny-llama-qlora", "LlamaConfig", TINY, "sdpa", quant=True, **small)]  # fmt: skip
        return {c.name: c for c in found}
    llama = shapes.config("llama-3.2-1b", max_position_embeddings=131072, rms_norm_eps=1e-5)
    qwen = shapes.config("qwen2.5-1.5b", max_position_embeddings=32768, rms_norm_eps=1e-6)
    found = [
        peer.Case("llama-3.2-1b", "LlamaConfig", llama, "sdpa"),
        peer.Case("llama-3.2-1b-qlora", "LlamaConfig", llama, "sdpa", quant=True),
        peer.Case("qwen2.5-1.5b", "Qwen2Config", qwen, "sdpa"),
    ]
    return {c.name: c for c in found}


def result_name(smoke: bool) -> str:
    """Smoke rows never join the measured ones (tiny shapes are not results)."""
    return f"{NAME}_smoke" if smoke else NAME


# -- the search -----------------------------------------------------------------------------------------------------


def longest_fitting(fits: Callable[[int], bool], low: int, high: int, step: int) -> int | None:
    """The longest of ``low, low + step, ... <= high`` for which ``fits`` holds, or None when ``low`` does not fit.

    Bisection over the grid, assuming a length that fits means every shorter one fits: ``low`` first, then the
    midpoints, about log2(grid size) + 1 calls, never ``high`` unless everything below it fits. The answer is always a
    length ``fits`` returned True for, even if the predicate is not monotone (a noisy probe)."""
    if step <= 0 or low <= 0 or low > high:
        raise ValueError(f"need 0 < low <= high and step > 0, got low={low}, high={high}, step={step}")
    if not fits(low):
        return None
    good, bad = 0, (high - low) // step + 1  # grid indices: good fits, bad is past the last known fit
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(low + mid * step):
            good = mid
        else:
            bad = mid
    return low + good * step


def grid_high(high: int, limit: int | None, low: int, step: int) -> int:
    """``high`` lowered to the model's position range, on the grid that starts at ``low``."""
    top = min(high, limit) if limit else high
    return max(low, low + (top - low) // step * step)


# -- the command line -----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    text = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=text.split("\n\n")[0],
        epilog=text[text.find("On the GPU machine") :],  # the commands
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--longest", action="store_true", help="find the longest sequence under --cap-gib (bisection)")
    add("--smoke", action="store_true", help="a tiny model (still CUDA): checks the script in seconds")
    # names separated by commas or spaces: gpu_run.sh splits its NAME=ARGS on commas
    add("--cases", nargs="*", default=[], help=f"(default: {','.join(STEP_CASES)}; --longest: "
        f"{','.join(LONGEST_CASES)}; --smoke: its tiny cases)")  # fmt: skip
    add("--variants", nargs="*", default=[], help=f"of {','.join(VARIANTS)} (default: all; --longest: "
        f"{','.join(LONGEST_VARIANTS)})")  # fmt: skip
    add("--rounds", type=int, default=None, help="runs of every case, variants in the same order each time "
        "(A B A B; default 2, smoke 1)")  # fmt: skip
    add("--warmup", type=int, default=None, help="untimed steps (default 3; smoke 1)")
    add("--timed", type=int, default=None, help="timed steps (default 8; smoke 2)")
    add("--timeout", type=int, default=300, help="seconds per variant process (step mode)")
    add("--cap-gib", type=float, default=24.0, help="--longest: the GPU memory cap in GiB")
    add("--low", type=int, default=None, help=f"--longest: shortest length tried (default {GRID[0]})")
    add("--high", type=int, default=None, help=f"--longest: longest length tried (default {GRID[1]})")
    add("--step", type=int, default=None, help=f"--longest: the lengths' grid (default {GRID[2]})")
    add("--parallel", type=int, default=1, help="--longest: variants of a case searched at once (each under its "
        "own cap; the step time at each longest length is then measured alone)")  # fmt: skip
    add("--probe-timeout", type=int, default=300, help="--longest: seconds per probe process")
    add("--out", default="", help="results directory (default $BENCH_RESULTS, else benchmarks/results)")
    add("--options", nargs="*", default=[], metavar="NAME=VALUE", help="patch_trainer options of both leantrain "
        "variants, e.g. layer_kernels=True (values read as Python literals; recorded in the rows)")  # fmt: skip
    add("--trace-peak", type=int, default=None, metavar="STEP", help="record the allocator's history in step STEP "
        "(1-based) and list what is alive at its peak (slows that step; step mode). torch 2.11 fails a compiled "
        "region under checkpointing while the history records (pytorch#179536): trace the eager layers there "
        "(--options compile_layers=False), or count a compiled layer's saves with bench_layer_saves.py")  # fmt: skip
    add("--phase-marks", type=int, default=None, metavar="STEP", help="mark memory at each layer's backward in "
        "step STEP (where the step peaks; any layers, compiled too)")  # fmt: skip
    add("--log-chars", type=int, default=3000, help="tail of a failed process's log to print")
    add("--merge", nargs="+", default=[], help="offload_checkpoints.json files of several runs (device calls) to "
        "join into --out; a (case, variant) in several keeps its latest")  # fmt: skip
    for hidden in ("--worker", "--case", "--model-dir", "--json"):
        add(hidden, help=argparse.SUPPRESS)
    for hidden in ("--seq", "--batch"):
        add(hidden, type=int, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments with the mode's defaults filled in (``cases``/``variants`` become lists, the
    search range is set); bad input exits through ``parser.error`` (code 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker or args.merge:
        return args
    try:
        patch_options(args.options)
    except ValueError as error:
        parser.error(str(error))
    known = cases(args.smoke)
    default_cases = list(known) if args.smoke else list(LONGEST_CASES if args.longest else STEP_CASES)
    args.cases = pick(parser, "case", args.cases, list(known), default_cases)
    default = LONGEST_VARIANTS if args.longest else VARIANTS
    args.variants = pick(parser, "variant", args.variants, VARIANTS, list(default))
    smoke = args.smoke
    grid = SMOKE_GRID if smoke else GRID
    args.low = grid[0] if args.low is None else args.low
    args.high = grid[1] if args.high is None else args.high
    args.step = grid[2] if args.step is None else args.step
    args.warmup = (1 if smoke else 3) if args.warmup is None else args.warmup
    args.timed = (2 if smoke else 8) if args.timed is None else args.timed
    args.rounds = (1 if smoke else 2) if args.rounds is None else args.rounds
    for problem in range_problems(args):
        parser.error(problem)
    return args


def pick(parser: argparse.ArgumentParser, what: str, given: list[str], allowed: Sequence[str], default: list) -> list:
    """The names in ``given`` (each item comma-separated; none: ``default``), each in ``allowed``, without repeats,
    in ``allowed``'s order."""
    names = [n.strip() for item in given for n in item.split(",") if n.strip()] or default
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"unknown {what}(s) {', '.join(unknown)}: choose from {', '.join(allowed)}")
    return [n for n in allowed if n in names]


def range_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.rounds < 1 or args.warmup < 0 or args.timed < 1:
        problems.append("--rounds and --timed must be at least 1, --warmup at least 0")
    if args.timeout <= 0 or args.probe_timeout <= 0:
        problems.append("--timeout and --probe-timeout must be positive")
    if not args.cap_gib > 0:
        problems.append(f"--cap-gib must be positive, got {args.cap_gib}")
    if args.step <= 0 or args.low <= 0 or args.low > args.high:
        problems.append(f"need 0 < --low <= --high and --step > 0, got {args.low}, {args.high}, {args.step}")
    elif args.low % args.step or args.high % args.step:
        problems.append(f"--low ({args.low}) and --high ({args.high}) must be multiples of --step ({args.step})")
    return problems


# -- the worker: one variant, one case (or one probe length), in its own process --------------------------------------


def worker_main(args: argparse.Namespace) -> int:
    """Train (or ``prepare`` the weights) and write the record; an error is the record (the parent reads it)."""
    case = cases(args.smoke)[args.case]
    case = dataclasses.replace(case, seq=args.seq or case.seq, batch=args.batch or case.batch,
                               steps=(args.warmup, args.timed))  # fmt: skip
    rec: dict[str, Any] = {"case": case.name, "variant": args.worker, "status": "ok", "reason": "",
                           "seq": case.seq, "batch": case.batch, "steps": []}  # fmt: skip
    try:
        if args.worker == "prepare":
            rec.update(peer.prepare(case, Path(args.model_dir), cuda=True))
        else:
            cap = args.cap_gib if args.longest else None
            rec["options"] = patch_options(args.options)
            train_one(case, args.worker, Path(args.model_dir), cap, rec, args.trace_peak, args.phase_marks)
    except Exception as error:  # an OOM is a result ("does not fit"), any other failure too (Unsloth on a family)
        traceback.print_exc()
        rec.update(status=failure_kind(error), reason=f"{type(error).__name__}: {error}"[:800])
    rec["date"] = now()
    Path(args.json).write_text(json.dumps(rec, default=str))
    return 0


def failure_kind(error: BaseException) -> str:
    """The status of a failed run: ``oom`` for torch.cuda.OutOfMemoryError and for allocator failures raised as other
    types (cuBLAS, bitsandbytes), else ``failed``."""
    return "oom" if type(error).__name__ == "OutOfMemoryError" or "out of memory" in str(error).lower() else "failed"


def train_one(
    case: peer.Case,
    variant: str,
    model_dir: Path,
    cap_gib: float | None,
    rec: dict[str, Any],
    trace_step: int | None,
    mark_step: int | None = None,
) -> None:
    """Build, patch and train, filling ``rec`` as it goes: what was learnt before an error (device, versions, the cap)
    stays in the record the worker writes."""
    if variant == "unsloth":
        try:
            import unsloth  # noqa: F401  first: it patches transformers, TRL and PEFT as they are imported
        except ModuleNotFoundError as error:
            rec.update(status="not installed", reason=f"unsloth does not import ({error})")
            return
    import torch
    import transformers
    from recipes.runner import StepClock, collect, summary

    rec["device"], rec["versions"] = torch.cuda.get_device_name(0), peer.stack_versions()
    rec["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    skip = skip_reason(case, variant)
    if skip:
        rec.update(status="skipped", reason=skip)
        return
    if cap_gib:
        rec["cap"] = cap_memory(cap_gib)
    with tempfile.TemporaryDirectory() as out:
        build = unsloth_trainer if variant == "unsloth" else hf_trainer
        trainer = build(case, variant, model_dir, out)
        peer.tell_run_length(trainer, sum(case.steps))
        report = patch(trainer, variant, rec.get("options", {}))
        if report is not None:
            print(report, flush=True)
        rec["args"] = peer.trainer_settings(trainer)
        rec["checkpointing_kwargs"] = str(checkpointing_kwargs(trainer.args))
        rec["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        clock = StepClock(True, f"{case.name} {variant} {case.batch}x{case.seq}")
        clock.install(trainer)
        trainer.add_callback(memory_peak.step_peaks_callback(rec, trace_step))
        if mark_step is not None:
            trainer.add_callback(memory_peak.phase_marks_callback(rec, mark_step))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        rec["base_gib"] = torch.cuda.memory_allocated() / GIB  # weights and adapters, before the first step
        transformers.set_seed(0)
        trainer.train()
        collect(rec, trainer, clock, case.steps)
        rec["peak_gib"] = max([torch.cuda.max_memory_allocated() / GIB, *rec.get("step_peaks_gib", [])])
        rec["reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        rec["stats"] = offload_stats(trainer)
        rec["report"] = outcomes(trainer)
        fell = {name: text for name, (status, *text) in rec["report"].items() if status == "failed"}
    rec["summary"] = summary(rec)
    rec["first_step_s"] = rec["steps"][0]["total_ms"] / 1e3
    if fell:  # the steps ran partly on the stock path: not what the variant is named for
        rec.update(status="fell back", reason="; ".join(f"{k}: {' '.join(v)}" for k, v in fell.items()))


def skip_reason(case: peer.Case, variant: str) -> str | None:
    import importlib.util

    if case.quant and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed: no nf4 base weights"
    if variant == "hf_offload":
        return hf_offload_reason()
    return None


def hf_offload_reason() -> str | None:
    """None where transformers' checkpointing takes ``offload`` (5.x with activation_checkpointing_enable), else why
    the variant is skipped."""
    import inspect

    import transformers
    from transformers import PreTrainedModel

    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        method = getattr(PreTrainedModel, name, None)
        if method is not None and "offload" in inspect.signature(method).parameters:
            return None
    return f"transformers {transformers.__version__} has no offload option for activation checkpointing"


def cap_memory(cap_gib: float) -> dict[str, float]:
    """Cap this process's CUDA caching allocator at ``cap_gib`` (pinned host memory is not counted)."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, cap_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return {"cap_gib": cap_gib, "total_gib": round(total / GIB, 2), "fraction": fraction}


def checkpointing_switch() -> str:
    """The installed transformers' name for the checkpointing switch (5.23 deprecates gradient_checkpointing)."""
    from recipes.runner import checkpointing

    return next(iter(checkpointing(True)))


def checkpointing_kwargs(args: Any) -> Any:
    return getattr(args, f"{checkpointing_switch()}_kwargs", None)


def sft_config(case: peer.Case, out: str, variant: str) -> Any:
    """bench_vs_unsloth's arguments (transformers' defaults pinned where Unsloth's SFTConfig swaps them), plus
    transformers' offload in the kwargs for hf_offload."""
    import dataclasses as dc

    from transformers import TrainingArguments
    from trl import SFTConfig

    defaults = {f.name: f.default for f in dc.fields(TrainingArguments) if f.name in peer.PINNED}
    switch = checkpointing_switch()
    extra = {f"{switch}_kwargs": dict(HF_OFFLOAD)} if variant == "hf_offload" else {}
    return SFTConfig(
        output_dir=out, max_steps=sum(case.steps), bf16=True, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, dataloader_num_workers=0, dataset_num_proc=None, learning_rate=peer.LR,
        per_device_train_batch_size=case.batch, max_length=case.seq, **{switch: True}, **extra, **defaults,
    )  # fmt: skip


def hf_trainer(case: peer.Case, variant: str, model_dir: Path, out: str) -> Any:
    """The saved weights (nf4 for QLoRA) with PEFT LoRA through ``SFTTrainer(peft_config=...)``."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    quant = {"quantization_config": peer.bnb_config()} if case.quant else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation=case.attention, device_map={"": "cuda"}, **quant
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=peer.LORA_TARGETS)
    return SFTTrainer(
        model=model.train(), args=sft_config(case, out, variant), train_dataset=peer.dataset(case),
        processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=lora,
    )  # fmt: skip


def unsloth_trainer(case: peer.Case, variant: str, model_dir: Path, out: str) -> Any:
    """Unsloth's documented path, as bench_vs_unsloth runs it (use_gradient_checkpointing="unsloth")."""
    trainer, _ = peer.unsloth_trainer(case, model_dir, out, cuda=True)
    return trainer


def patch(trainer: Any, variant: str, options: dict[str, Any]) -> Any:
    """leantrain's call for the variant (None for the others), with ``--options``. offload_checkpoints=True raises
    where it cannot apply: the record is that error."""
    import leantrain

    if variant == "leantrain":
        return leantrain.patch_trainer(trainer, **{**options, "offload_checkpoints": False})
    if variant == "leantrain_offload":
        return leantrain.patch_trainer(trainer, **{**options, "offload_checkpoints": True})
    return None


def patch_options(items: Sequence[str]) -> dict[str, Any]:
    """``NAME=VALUE`` items (each may hold several, comma-separated) as keyword arguments; a value that is not a
    Python literal stays a string."""
    import ast

    options: dict[str, Any] = {}
    for item in (part for given in items for part in given.split(",") if part.strip()):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--options takes NAME=VALUE items, got {item!r}")
        try:
            options[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[name.strip()] = value.strip()
    return options


def offload_stats(trainer: Any) -> dict[str, Any] | None:
    from leantrain.offload_checkpoints import stats

    found = stats(trainer)
    return None if found is None else dataclasses.asdict(found)


def outcomes(trainer: Any) -> dict[str, list[str]]:
    """The report after training: name -> [status, first reason] (a runtime fallback turns a status to failed)."""
    report = getattr(trainer, "leantrain_report", None)
    if report is None:
        return {}
    return {o.name: [o.status.value, *o.reasons[:1]] for o in report.outcomes}


# -- the parent: one process per variant and round (or per probe) ---------------------------------------------------


def worker_env(variant: str) -> dict[str, str]:
    """No LEANTRAIN_* from the caller's shell (``leantrain`` means the defaults); Unsloth's site folder on the unsloth
    process's path only; every process offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEANTRAIN_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1", PYTHONUNBUFFERED="1")
    paths = [str(HERE.parent / "src"), str(HERE), str(HERE.parent)]
    if variant == "unsloth" and os.environ.get("UNSLOTH_SITE"):
        paths.append(os.environ["UNSLOTH_SITE"])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def run_child(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int | None, str]:
    """(exit code or None on timeout, output): on timeout the child's whole process group goes (compile workers)."""
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended between the timeout and the kill
            pass
        output, _ = proc.communicate()
        return None, output


def spawn(case: peer.Case, variant: str, model_dir: Path, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """One worker process; its record, or a record saying why there is none (crash, timeout)."""
    work = Path(tempfile.mkdtemp(prefix=f"offload_{variant}_"))  # its cwd: Unsloth writes its compiled cache there
    out = work / "record.json"
    seq, batch, longest = extra.get("seq"), extra.get("batch"), extra.get("longest", False)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--case", case.name,
               "--model-dir", str(model_dir), "--json", str(out), "--warmup", str(extra.get("warmup", args.warmup)),
               "--timed", str(extra.get("timed", args.timed)), "--cap-gib", str(args.cap_gib)]  # fmt: skip
    command += (["--seq", str(seq)] if seq else []) + (["--batch", str(batch)] if batch else [])
    command += (["--longest"] if longest else []) + (["--smoke"] if args.smoke else [])
    command += ["--trace-peak", str(args.trace_peak)] if args.trace_peak and not longest else []
    command += ["--phase-marks", str(args.phase_marks)] if args.phase_marks and not longest else []
    command += ["--options", *args.options] if args.options else []
    timeout = args.probe_timeout if longest else args.timeout
    started = time.perf_counter()
    code, log = run_child(command, worker_env(variant), work, timeout)
    rec = read_record(out, code, log, timeout)
    rec.update(case=case.name, variant=variant, wall_s=round(time.perf_counter() - started, 1))
    rec.setdefault("date", now())
    if rec["status"] not in ("ok", *SKIPS) and args.log_chars:
        print(log[-args.log_chars :], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return rec


def read_record(path: Path, code: int | None, log: str, timeout: float) -> dict[str, Any]:
    if code is None:
        return {"status": "timeout", "reason": f"timed out after {timeout:.0f} s: {peer.tail(log)}"}
    rec = json.loads(path.read_text()) if path.exists() else None
    if rec is None:
        return {"status": "crashed", "reason": f"exit {code} without a record: {peer.tail(log)}"}
    if code != 0 and rec["status"] == "ok":
        return {**rec, "status": "crashed", "reason": f"exit {code} after its record: {peer.tail(log)}"}
    return rec


class Weights:
    """The saved random-init weights of one shape (the Llama cases share them), built by a ``prepare`` process and
    removed when the shape changes or the run ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.key, self.dir, self.ready = args, None, None, None

    def for_case(self, case: peer.Case) -> tuple[Path, dict]:
        key = json.dumps([case.cls, case.fields], sort_keys=True)
        if key != self.key:
            self.close()
            self.key, self.dir = key, Path(tempfile.mkdtemp(prefix="offload_model_"))
            self.ready = spawn(case, "prepare", self.dir, self.args)
            print(f"[prepare] {case.name}: {self.ready['status']} {self.ready.get('reason', '')[:300]} "
                  f"({self.ready['wall_s']:.0f} s)", flush=True)  # fmt: skip
        return self.dir, self.ready

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.key = self.dir = None


def not_built(ready: dict) -> dict[str, Any] | None:
    if ready["status"] == "ok":
        return None
    return {"status": "failed", "reason": f"model not built: {ready['reason']}", "date": now()}


def run_steps(args: argparse.Namespace) -> int:
    """Every case: its variants in order, ``--rounds`` times (A B A B), rows written after every process."""
    known = cases(args.smoke)
    runs: dict[tuple[str, str], list[dict]] = {}
    weights = Weights(args)
    try:
        for name in args.cases:
            case = known[name]
            model_dir, ready = weights.for_case(case)
            for round_ in range(1, args.rounds + 1):
                for variant in args.variants:
                    done = runs.setdefault((name, variant), [])
                    if done and done[-1]["status"] in SKIPS:
                        continue
                    rec = not_built(ready) or spawn(case, variant, model_dir, args)
                    done.append({**rec, "case": name, "variant": variant, "round": round_})
                    print(step_line(done[-1]), flush=True)
                    write(step_rows(runs, known), args)
    finally:
        weights.close()
    bad = [k for k, recs in runs.items() if k[1] in ("stock", "leantrain", "leantrain_offload")
           and any(r["status"] not in ("ok", *SKIPS) for r in recs)]  # fmt: skip
    if bad:
        print(f"failed runs: {bad}", file=sys.stderr)
    return 1 if bad else 0


class Skipped(Exception):
    """A probe said the variant cannot run at all (not installed, skipped): no length to search for."""

    def __init__(self, rec: dict) -> None:
        super().__init__(rec.get("reason", ""))
        self.rec = rec


def run_longest(args: argparse.Namespace) -> int:
    """Every (case, variant): the bisection, a process per probe, rows written after every probe. ``--parallel N``:
    up to N variants of a case search at once (each process under its own cap), then each longest length is trained
    again alone for its step time."""
    known = cases(args.smoke)
    results: dict[tuple[str, str], dict] = {}
    weights = Weights(args)
    lock = threading.Lock()

    def saved() -> None:
        with lock:
            write(longest_rows(results), args)

    try:
        for name in args.cases:
            case = known[name]
            model_dir, ready = weights.for_case(case)
            high = grid_high(args.high, case.fields.get("max_position_embeddings"), args.low, args.step)
            recs = [results.setdefault((name, v), search_record(name, v, args, high)) for v in args.variants]

            def one(rec: dict, case: peer.Case = case, model_dir: Path = model_dir, ready: dict = ready) -> None:
                failed = not_built(ready)
                if failed:
                    rec.update(failed)
                else:
                    search(case, rec["variant"], model_dir, args, rec, saved)
                print(longest_line(rec), flush=True)
                saved()

            with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
                list(pool.map(one, recs))  # list(): a search's exception surfaces here
            if args.parallel > 1:  # searched side by side: each longest length's step time, measured alone
                for rec in recs:
                    retime(case, model_dir, args, rec)
                    saved()
    finally:
        weights.close()
    return 0


def retime(case: peer.Case, model_dir: Path, args: argparse.Namespace, rec: dict) -> None:
    """Train the longest length found once more with the GPU to itself: its step time and peaks (``rec["alone"]``)."""
    if rec["status"] != "ok" or rec["longest"] is None:
        return
    seq = rec["longest"]
    probe = spawn(case, rec["variant"], model_dir, args, seq=seq, batch=1, warmup=1, timed=1, longest=True)
    rec["alone"] = compact(probe, seq)
    print(probe_line(case.name, rec["variant"], rec["alone"]).replace("[longest]", "[alone]"), flush=True)


def parallel_problem(parallel: int, cap_gib: float, total_gib: float) -> str | None:
    """Why ``parallel`` processes under ``cap_gib`` each would not fit a GPU of ``total_gib`` (None: they fit, with
    a tenth kept for the CUDA contexts)."""
    if parallel < 1:
        return f"--parallel must be at least 1, got {parallel}"
    if parallel > 1 and parallel * cap_gib > 0.9 * total_gib:
        return (f"--parallel {parallel} x --cap-gib {cap_gib:g} = {parallel * cap_gib:g} GiB is more than 90% of "
                f"this GPU's {total_gib:.0f} GiB: lower --parallel")  # fmt: skip
    return None


def search_record(case: str, variant: str, args: argparse.Namespace, high: int) -> dict[str, Any]:
    grid = {"cap_gib": args.cap_gib, "low": args.low, "high": high, "step": args.step}
    grid["parallel"] = getattr(args, "parallel", 1)  # searched side by side when > 1
    return {"case": case, "variant": variant, "status": "searching", "reason": "", **grid, "longest": None,
            "probes": [], "date": now()}  # fmt: skip


def search(case: peer.Case, variant: str, model_dir: Path, args: argparse.Namespace, rec: dict, saved: Any) -> None:
    """Fill ``rec`` by bisection; ``saved()`` after every probe (a run cut off keeps the probes so far)."""

    def fits(seq: int) -> bool:
        probe = spawn(case, variant, model_dir, args, seq=seq, batch=1, warmup=1, timed=1, longest=True)
        rec["probes"].append(compact(probe, seq))
        rec.update(date=probe["date"], **{k: probe[k] for k in ("device", "versions") if probe.get(k)})
        ok = probe["status"] == "ok"
        if ok and seq > (rec["longest"] or 0):
            rec["longest"] = seq  # the best so far: what a cut-off run reports
        print(probe_line(case.name, variant, rec["probes"][-1]), flush=True)
        saved()
        if probe["status"] in SKIPS:
            raise Skipped(probe)
        return ok

    try:
        rec["longest"] = longest_fitting(fits, rec["low"], rec["high"], rec["step"])
        rec["status"] = "ok"
    except Skipped as skip:
        rec.update(status=skip.rec["status"], reason=skip.rec.get("reason", ""), longest=None)


def write(new: list[Any], args: argparse.Namespace, merge: bool = False) -> Path:
    """``new`` over the rows already in the results directory (each (case, variant) from its latest run); then the
    JSON, the markdown and the plot. ``merge``: ``new`` holds whole earlier runs (device calls) to join."""
    from _harness import RESULTS, previous_rows, write_results

    name = result_name(args.smoke)
    out_dir = Path(args.out or os.environ.get("BENCH_RESULTS", RESULTS))
    keys = {(r.mode, r.provider) for r in new}
    kept = [r for r in previous_rows(name, out_dir, args.smoke) if merge or (r.mode, r.provider) not in keys]
    rows = latest(kept + list(new))
    out = write_results(name, rows, tables(rows), out_dir)
    try:
        plot(rows, out / f"{name}.png")
    except Exception as error:  # the rows and the table are the result; a plot failure must not lose them
        print(f"plot failed: {error}", flush=True)
    return out


# -- main ------------------------------------------------------------------------------------------------------------


NO_CUDA = (
    "bench_offload_checkpoints.py needs a CUDA GPU (torch.cuda.is_available() is False here): run it on the GPU "
    "machine (its docstring has the commands); --help and --merge work anywhere"
)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.merge:
        from _harness import read_rows

        print(f"merged into {write([r for p in args.merge for r in read_rows(Path(p))], args, merge=True)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    if args.longest:
        import torch

        total = torch.cuda.get_device_properties(0).total_memory / GIB
        problem = parallel_problem(args.parallel, args.cap_gib, total)
        if problem:
            print(f"bench_offload_checkpoints.py: {problem}", file=sys.stderr)
            return 2
        return run_longest(args)
    return run_steps(args)


if __name__ == "__main__":
    raise SystemExit(main())
