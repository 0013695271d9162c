"""leantrain against Unsloth on the same TRL ``SFTTrainer`` runs: each (case, provider) in its own Python process.

Providers: ``stock`` (TRL + PEFT as installed), ``leantrain`` (``patch_trainer(trainer)``), ``leantrain_compiled``
(``patch_trainer(trainer, compile_layers=True, compile_layers_background=False)``: compiled in the training process;
recorded as skipped when the installed leantrain has no compile_layers option),
``leantrain_offload`` (``patch_trainer(trainer, offload_checkpoints=True)``; only when named in ``--providers``),
``leantrain_background`` (``patch_trainer(trainer, compile_layers=True, compile_layers_background=True)``: the layers
compile in a child process while the first steps run uncompiled; only when named, with ``--timed-steps`` long enough
for the switch, e.g. ``--cases moe-qlora --providers leantrain_compiled,leantrain_background --timed-steps 1000``)
and ``unsloth`` (``FastLanguageModel.from_pretrained`` of the same random-init weights saved to a local directory,
``FastLanguageModel.get_peft_model`` with its own gradient checkpointing, then TRL's ``SFTTrainer``, which Unsloth
patches). Unsloth patches transformers, TRL and PEFT for the whole process, so every provider runs in a fresh
process, with fresh torch.compile caches (``TORCHINDUCTOR_CACHE_DIR`` and Unsloth's compiled-code directory are
per process): every first step is a cold start.

Cases (random-init public shapes with their real vocabularies, LoRA r16 alpha 32 on all 7 projections, head frozen,
bf16, activation checkpointing, AdamW, lr 2e-4, logging every step):
- ``llama-3.2-1b``, ``qwen2.5-1.5b``, ``gemma-2-2b`` (eager attention), ``qwen3-8b``: fixed 4 x 2048 tokens, no
  padding, median of 8 steps after 3 warm-up steps;
- ``llama-3.2-1b-qlora``: the same on nf4 double-quant weights (bitsandbytes, bf16 compute);
- ``llama-3.2-1b-varlen``: 4 sequences a step, lognormal lengths (median 500, clipped to [64, 2048]), padded per
  batch by TRL's collator, 30 timed steps after 3: tokens/s on real (non-pad) tokens, and the torch.compile graphs
  made after the first step (``torch._dynamo`` counters: recompiles on new lengths);
- ``moe-qlora``: one Qwen3-30B-A3B decoder layer (128 experts, top 8, vocab 16384), 1 x 4096 tokens, attention in
  nf4, LoRA on attention and on the experts (stock: PEFT ``target_parameters`` on bf16 experts; leantrain: experts
  in 4-bit by ``quantize_experts_4bit``; Unsloth: its own MoE path), median of 8 after 3.

Every trainer is told a user's run length (``--run-steps``, 1000 by default: auto mode decides as it would for a
user's run, e.g. compiling the layers where the run pays the compile back) and stopped after its warm-up and timed
steps; the learning-rate schedule is the same for every provider.

Recorded per provider: median step (p20/p80), peak allocated GiB over training (weights included), the first step
and the cold start (process start to the end of the first step: imports, load, LoRA, compile), the loss of every
step (agreement with stock), the collator's padding mode, the dynamo graph counts. A provider that fails is a row
with its error (e.g. Unsloth on Gemma-2). Rows go to ``vs_unsloth.json`` / ``.md`` / ``.png`` in ``$BENCH_RESULTS``
(or ``benchmarks/results``); a run of a subset replaces only its own rows. ``BENCH_TRACE_STEP=N``: what is alive at
step N's peak (1-based), by the code that allocated it, in each record's ``peak_trace`` (``memory_peak.py``).

GPU: stage the repo (src, tests, benchmarks, examples, pyproject.toml) in a folder at the checkout root, carry it
with ``.whl_unsloth`` (``benchmarks/wheels_unsloth.sh``, 9 MB) and ``.whl_bnb`` (bitsandbytes), one GPU, and run from
the staged folder ``bash benchmarks/gpu_vs_unsloth.sh ARGS``. Every (case, provider) process costs its start-up and
cold compile: measured on an H200, a model's prepare 14-21 s, stock 26-48 s, leantrain 29 s, Unsloth 61-80 s per
process (the compiled provider not measured yet, estimate 45 s). The whole set does not fit one 10-minute device
call; four calls, then join their JSON:
    bash benchmarks/gpu_vs_unsloth.sh --cases llama-3.2-1b,llama-3.2-1b-qlora --timeout 200      # ~7 min
    bash benchmarks/gpu_vs_unsloth.sh --cases llama-3.2-1b-varlen,moe-qlora --timeout 200        # ~7.5 min
    bash benchmarks/gpu_vs_unsloth.sh --cases qwen2.5-1.5b,gemma-2-2b --timeout 200              # ~9 min
    bash benchmarks/gpu_vs_unsloth.sh --cases qwen3-8b --timeout 240                             # ~6 min (estimate)
    python benchmarks/bench_vs_unsloth.py --merge call1/vs_unsloth.json call2/vs_unsloth.json ... --out DIR
Rounds in alternating order: run twice, ``--providers`` reversed, ``--out r1`` / ``r2``, then ``--rounds
r1/vs_unsloth.json r2/vs_unsloth.json --cases CASE`` (``vs_unsloth_rounds_CASE``). A subset: ``--cases llama-3.2-1b
--providers stock,unsloth``. Results go to ``$OUT`` (JSON, markdown, PNG, log).
CPU smoke (tiny shapes, no Unsloth: it needs CUDA):
    python benchmarks/bench_vs_unsloth.py --smoke --providers stock,leantrain
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import memory_peak
from _vs_unsloth_report import WHOLE_RUN, plot, told, unlike_stock, whole_run


STARTED = time.perf_counter()  # a worker's cold start is measured from here (interpreter start excluded)
HERE = Path(__file__).resolve().parent
NAME = "vs_unsloth"
PROVIDERS = ("stock", "leantrain", "leantrain_compiled", "unsloth")
RUN_STEPS = 1000  # the run length every trainer is told (timing stops after warm-up + timed steps)
OPT_IN = ("leantrain_offload", "leantrain_background")  # run only when named in --providers (see patch())
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = LORA_TARGETS[:4]
STOCK_EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PAD = 0  # runner.TOKENS' pad id: the data never holds it (ids from 3), so non-pad tokens are the real ones
LR = 2e-4
UNSLOTH_MODULES = ("unsloth", "unsloth_zoo")
DEFAULT_CASES = ("llama-3.2-1b", "llama-3.2-1b-qlora", "llama-3.2-1b-varlen",  # the Llama cases share one saved model
                 "qwen2.5-1.5b", "gemma-2-2b", "moe-qlora")  # fmt: skip
QWEN3_8B = dict(  # Qwen/Qwen3-8B's config (untied head)
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)  # fmt: skip
QWEN3_30B_A3B_1L = dict(  # one decoder layer of Qwen3-30B-A3B, vocab 16384 (benchmarks/bench_moe4bit_step.py)
    hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, moe_intermediate_size=768, intermediate_size=6144, vocab_size=16384,
    max_position_embeddings=8192, num_hidden_layers=1, tie_word_embeddings=False, rms_norm_eps=1e-6,
)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)  # fmt: skip
TINY_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    cls: str  # transformers config class
    fields: dict
    attention: str
    kind: str = "fixed"  # fixed / varlen / moe
    quant: bool = False  # nf4 double-quant base weights
    batch: int = 4
    seq: int = 2048  # fixed length, or the longest a varlen row may be
    steps: tuple[int, int] = (3, 8)  # warm-up, timed
    median_len: int = 500  # varlen: lognormal median, clipped to [min_len, seq]
    min_len: int = 64


def _full_cases() -> dict[str, Case]:
    import shapes

    llama = shapes.config("llama-3.2-1b", max_position_embeddings=131072, rms_norm_eps=1e-5)
    qwen = shapes.config("qwen2.5-1.5b", max_position_embeddings=32768, rms_norm_eps=1e-6)
    gemma = shapes.config("gemma-2-2b", max_position_embeddings=8192, rms_norm_eps=1e-6)
    cases = [
        Case("llama-3.2-1b", "LlamaConfig", llama, "sdpa"),
        Case("qwen2.5-1.5b", "Qwen2Config", qwen, "sdpa"),
        Case("gemma-2-2b", "Gemma2Config", gemma, "eager"),
        Case("qwen3-8b", "Qwen3Config", QWEN3_8B, "sdpa"),
        Case("llama-3.2-1b-qlora", "LlamaConfig", llama, "sdpa", quant=True),
        Case("llama-3.2-1b-varlen", "LlamaConfig", llama, "sdpa", kind="varlen", steps=(3, 30)),
        Case("moe-qlora", "Qwen3MoeConfig", QWEN3_30B_A3B_1L, "sdpa", kind="moe", quant=True, batch=1, seq=4096),
    ]
    return {c.name: c for c in cases}


def _smoke_cases() -> dict[str, Case]:
    small = dict(batch=2, seq=64, steps=(1, 1))
    cases = [
        Case("tiny-llama", "LlamaConfig", TINY, "eager", **small),
        Case("tiny-llama-varlen", "LlamaConfig", TINY, "eager", kind="varlen", median_len=24, min_len=8, **small),
        Case("tiny-moe-qlora", "Qwen3MoeConfig", TINY_MOE, "eager", kind="moe", quant=True, **small),
    ]
    return {c.name: c for c in cases}


# -- the worker: one provider on one case, in its own process -----------------------------------------------------


def prepare(case: Case, model_dir: Path, cuda: bool) -> dict[str, Any]:
    """Save the seeded random-init model (and the tokenizer) every provider of the case loads: built on the device in
    bf16 (fp32 on the CPU), written with ``save_pretrained``."""
    import torch
    import transformers
    from recipes.runner import TOKENS, tokenizer

    config = getattr(transformers, case.cls)(**case.fields, **TOKENS)
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
    t0 = time.perf_counter()
    model.save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    return {"status": "ok", "save_s": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters())}


def dataset(case: Case) -> Any:
    """The case's rows, the same in every process: full-length random ids (fixed / moe), or lognormal lengths."""
    import torch
    from datasets import Dataset
    from recipes.runner import token_dataset

    vocab = case.fields["vocab_size"]
    rows = sum(case.steps) * case.batch
    if case.kind != "varlen":
        return token_dataset(vocab, rows, case.seq)
    g = torch.Generator().manual_seed(1)
    lengths = torch.exp(math.log(case.median_len) + 0.8 * torch.randn(rows, generator=g)).round()
    lengths = lengths.clamp(case.min_len, case.seq).long().tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]})


# Trainer settings every provider pins to transformers' own defaults: Unsloth's SFTConfig swaps the defaults of
# these (2 accumulated micro-batches, 8-bit AdamW, weight decay 0.001, 10% warm-up), and a comparison must run the same
# optimization. Its other defaults (padding-free batching on variable lengths, its loss path) are kept: they are
# how Unsloth trains, and each record says which it used (ARG_KEYS).
PINNED = ("gradient_accumulation_steps", "optim", "weight_decay", "warmup_steps", "lr_scheduler_type")
ARG_KEYS = (*PINNED, "learning_rate", "per_device_train_batch_size", "max_steps", "seed", "bf16", "max_length",
            "padding_free", "loss_type", "gradient_checkpointing", "activation_checkpointing")  # fmt: skip


def sft_args(case: Case, out: str, cuda: bool) -> Any:
    import dataclasses as dc

    from recipes.runner import checkpointing
    from transformers import TrainingArguments
    from trl import SFTConfig

    defaults = {f.name: f.default for f in dc.fields(TrainingArguments) if f.name in PINNED}
    return SFTConfig(
        output_dir=out, max_steps=sum(case.steps), bf16=cuda, use_cpu=not cuda, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0, dataset_num_proc=None,
        learning_rate=LR, per_device_train_batch_size=case.batch, max_length=case.seq, **checkpointing(cuda),
        **defaults,
    )  # fmt: skip


def tell_run_length(trainer: Any, steps: int, run_steps: int = RUN_STEPS) -> None:
    """Tell the trainer a user's run length (auto mode decides as it would for a user, e.g. compiling the layers) and
    stop it after ``steps``; every provider alike, so the learning-rate schedule is the same for all."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if state.global_step >= steps:
                control.should_training_stop = True
            return control

    trainer.args.max_steps = max(run_steps, steps)
    trainer.add_callback(StopAfter())


def trainer_settings(trainer: Any) -> dict[str, str]:
    """The settings the trainer really runs with (after Unsloth's patches, if any)."""
    return {k: str(getattr(trainer.args, k)) for k in ARG_KEYS if hasattr(trainer.args, k)}


def bnb_config() -> Any:
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )  # fmt: skip


def hf_trainer(case: Case, provider: str, model_dir: Path, out: str, cuda: bool) -> tuple[Any, dict]:
    """stock / leantrain / leantrain_compiled: ``from_pretrained`` of the saved weights (nf4 for QLoRA), PEFT LoRA
    through ``SFTTrainer(peft_config=...)``; leantrain's MoE providers put the experts in 4-bit first."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    import leantrain

    extra: dict[str, Any] = {}
    quant = {"quantization_config": bnb_config()} if case.quant and cuda else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation=case.attention,
        device_map={"": "cuda" if cuda else "cpu"}, **quant,
    )  # fmt: skip
    lora = dict(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=LORA_TARGETS)
    if case.kind == "moe":
        lora["target_modules"] = ATTENTION
        lora["target_parameters"] = STOCK_EXPERT_PARAMS
        if provider != "stock":
            extra["quantize_experts_4bit"] = str(leantrain.quantize_experts_4bit(model))
            lora["target_parameters"] = leantrain.expert_lora_targets(model)
    trainer = SFTTrainer(
        model=model.train(), args=sft_args(case, out, cuda), train_dataset=dataset(case),
        processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=LoraConfig(**lora),
    )  # fmt: skip
    return trainer, extra


def unsloth_trainer(case: Case, model_dir: Path, out: str, cuda: bool) -> tuple[Any, dict]:
    """Unsloth's documented path: ``FastLanguageModel.from_pretrained`` (a local directory: nothing downloaded), then
    ``get_peft_model`` on all 7 projections with ``use_gradient_checkpointing="unsloth"`` (its own offloaded
    checkpointing, its default), then TRL's ``SFTTrainer`` (Unsloth's patched one) with the same arguments and data.
    On the MoE case Unsloth adds the expert parameters to LoRA itself from ``gate_proj/up_proj/down_proj``."""
    import torch
    from trl import SFTTrainer
    from unsloth import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(
        str(model_dir), max_seq_length=case.seq, dtype=torch.bfloat16, load_in_4bit=case.quant,
        full_finetuning=False, fix_tokenizer=False, use_gradient_checkpointing="unsloth",
    )  # fmt: skip
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none", target_modules=LORA_TARGETS,
        use_gradient_checkpointing="unsloth", random_state=0,
    )  # fmt: skip
    data = dataset(case)
    trainer = SFTTrainer(model=model, args=sft_args(case, out, cuda), train_dataset=data, processing_class=tok)
    extra = {"gradient_checkpointing": 'unsloth (get_peft_model use_gradient_checkpointing="unsloth")'}
    extra["attention"] = str(getattr(model.config, "_attn_implementation", None))
    return trainer, extra


def patch(trainer: Any, provider: str) -> tuple[Any, str | None]:
    """(report or None, skip reason or None): leantrain's call for the provider."""
    import leantrain

    options = {"leantrain": {}, "leantrain_offload": {"offload_checkpoints": True},
               "leantrain_background": {"compile_layers": True, "compile_layers_background": True}}  # fmt: skip
    if provider in options:
        return leantrain.patch_trainer(trainer, **options[provider]), None
    if provider == "leantrain_compiled":
        try:
            return leantrain.patch_trainer(trainer, compile_layers=True, compile_layers_background=False), None
        except TypeError as error:  # an older leantrain: the option does not exist (unknown names raise TypeError)
            if "compile_layers_background" in str(error):
                return leantrain.patch_trainer(trainer, compile_layers=True), None
            if "compile_layers" not in str(error):
                raise
            return None, f"the installed leantrain has no compile_layers option ({error})"
    return None, None


COMPILES = [0]  # Dynamo compilations started in this process (every frame compiled, recompiles included)


def _started(*args: Any) -> None:
    COMPILES[0] += 1


def count_compiles() -> None:
    """Count compilations with Dynamo's compile-start callback, registered again whenever ``torch._dynamo.reset()``
    (which Unsloth calls, e.g. when a compiled loss fails) has removed it: with the counters (which reset keeps),
    neither a reset nor a cleared counter loses the count of what compiled since the last check."""
    from torch._dynamo.callback import callback_handler

    if _started not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_started)


def graphs() -> int:
    """torch.compile graphs made so far in this process: the larger of Dynamo's unique-graph counter and the
    compile-start count."""
    from torch._dynamo.utils import counters

    count_compiles()
    return max(int(counters["stats"]["unique_graphs"]), COMPILES[0])


def install_clock(trainer: Any, cuda: bool, label: str) -> Any:
    """The recipes' step clock (benchmarks/recipes/runner.py: CUDA-synchronized, per-step split), counting real
    (non-pad) tokens, and per step: the Dynamo graph count, the first step's end (cold start), the step's own peak
    (the allocator's peak is reset at each step's end) and the peak so far."""
    import torch
    from recipes.runner import StepClock
    from transformers import TrainerCallback

    class Clock(StepClock):
        def _count_tokens(self, result: Any, args: tuple) -> None:
            inputs = args[1] if len(args) > 1 else None
            if isinstance(inputs, dict) and torch.is_tensor(inputs.get("input_ids")):
                self.tokens += int((inputs["input_ids"] != PAD).sum())
                self.extra["padded_tokens"] = self.extra.get("padded_tokens", 0) + inputs["input_ids"].numel()

    clock = Clock(cuda, label)

    class Graphs(TrainerCallback):  # added before the clock's own: sits between its First and Last callbacks
        so_far = 0.0  # the clock's extra is new each step

        def on_step_end(self, args, state, control, **kwargs):
            clock.extra["graphs"] = graphs()
            if cuda:  # this step's peak (since the last step's end), then the reset for the next
                step_peak = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
                self.so_far = max(self.so_far, step_peak)
                clock.extra["step_peak_gib"], clock.extra["peak_so_far_gib"] = step_peak, self.so_far
            clock.extra["since_start_s"] = clock.now() - STARTED  # process start to this step's end

    trainer.add_callback(Graphs())
    clock.install(trainer)
    return clock


def run_worker(case: Case, provider: str, model_dir: Path, cuda: bool, run_steps: int = RUN_STEPS) -> dict[str, Any]:
    rec: dict[str, Any] = {"case": case.name, "provider": provider, "status": "ok", "reason": ""}
    t0 = time.perf_counter()
    if provider == "unsloth":
        import unsloth  # noqa: F401  first: it patches transformers, TRL and PEFT as they are imported
    import torch
    import transformers
    from recipes.runner import collect, summary

    rec["import_s"] = time.perf_counter() - t0
    count_compiles()
    rec["device"], rec["versions"] = device(), stack_versions()
    with tempfile.TemporaryDirectory() as out:
        t1 = time.perf_counter()
        if provider == "unsloth":
            trainer, extra = unsloth_trainer(case, model_dir, out, cuda)
        else:
            trainer, extra = hf_trainer(case, provider, model_dir, out, cuda)
        rec["build_s"] = time.perf_counter() - t1
        tell_run_length(trainer, sum(case.steps), run_steps)
        rec["told_steps"] = trainer.args.max_steps
        t2 = time.perf_counter()
        report, skip = patch(trainer, provider)
        rec["patch_s"] = time.perf_counter() - t2
        if skip:
            return {**rec, "status": "skipped", "reason": skip}
        if report is not None:
            rec["report"] = report.to_dict()
            print(report, flush=True)
        packed = getattr(trainer.args, "padding_free", False) or getattr(trainer.data_collator, "padding_free", False)
        rec["extra"] = {**extra, "padding_free": bool(packed)}  # the trainer's setting, or leantrain's padding_free
        rec["args"] = trainer_settings(trainer)
        rec["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        if cuda and os.environ.get("BENCH_TRACE_STEP"):  # what is alive at that step's peak (memory_peak.py)
            trainer.add_callback(memory_peak.step_peaks_callback(rec, int(os.environ["BENCH_TRACE_STEP"])))
        clock = install_clock(trainer, cuda, f"{case.name} {provider}")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        transformers.set_seed(0)
        trainer.train()
        collect(rec, trainer, clock, case.steps)
    # the steps' peaks (the clock resets the allocator's at each step's end) and whatever ran after the last
    so_far = [st.get("peak_so_far_gib") or 0.0 for st in rec["steps"]]
    rec["peak_gib"] = max([torch.cuda.max_memory_allocated() / 2**30, *so_far]) if cuda else None
    rec["summary"] = summary(rec)
    first = rec["steps"][0]
    rec["first_step_s"] = first["total_ms"] / 1e3
    rec["cold_start_s"] = first.get("since_start_s")
    rec["to_last_step_s"] = rec["steps"][-1].get("since_start_s")  # process start to the last step's end
    if provider.startswith("leantrain"):  # auto mode compiles MoE-4bit layers in a child too
        rec["background"] = background_summary(trainer) or None
    rec["graphs_total"] = rec["steps"][-1].get("graphs", 0)
    rec["graphs_after_first_step"] = rec["graphs_total"] - first.get("graphs", 0)
    return rec


def background_summary(trainer: Any) -> dict[str, Any]:
    """The background compile's children (seconds from the trace to the step boundary that saw each finished, or
    why it failed), the graphs compiled in the training process and why, and how many switched from the cache."""
    from leantrain.compile_layers import stats

    live = getattr(stats(trainer), "background", None)
    if live is None:
        return {}
    jobs = [{"done": j.done, "seconds": j.seconds, "failed": j.failed} for j in live.jobs.values()]
    return {
        "jobs": jobs,
        "in_process": list(live.in_process),
        "retraced": live.retraced,
        "eager_steps": live.eager_steps,
    }


def device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def stack_versions() -> dict[str, str]:
    from importlib import metadata

    import torch

    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in ("transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "liger-kernel", "leantrain",
                 "unsloth", "unsloth_zoo"):  # fmt: skip
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def worker_main(args: argparse.Namespace) -> None:
    case = cases(args.smoke, args.timed_steps)[args.case]
    cuda = not args.smoke
    if not cuda:
        import torch

        torch.set_num_threads(min(2, os.cpu_count() or 1))
    try:
        if args.worker == "prepare":
            rec = prepare(case, Path(args.model_dir), cuda)
        else:
            rec = run_worker(case, args.worker, Path(args.model_dir), cuda, args.run_steps)
    except Exception as error:  # the row records it (Unsloth on some families, an OOM): the run goes on
        traceback.print_exc()
        kind = "oom" if "out of memory" in str(error).lower() else "failed"
        reason = f"{type(error).__name__}: {error}"
        rec = {"case": case.name, "provider": args.worker, "status": kind, "reason": reason}
    Path(args.json).write_text(json.dumps(rec, default=str))


# -- the parent: one process per (case, provider), then rows, table and plot -----------------------------------------


def cases(smoke: bool, timed_steps: int = 0) -> dict[str, Case]:
    """The cases; ``timed_steps`` > 0 replaces every case's timed step count (its warm-up kept)."""
    known = _smoke_cases() if smoke else _full_cases()
    if timed_steps > 0:
        known = {k: dataclasses.replace(c, steps=(c.steps[0], timed_steps)) for k, c in known.items()}
    return known


def spawn(case: Case, who: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run one worker with fresh compile caches and its own working directory; its record, or why there is none."""
    work = Path(tempfile.mkdtemp(prefix=f"vs_unsloth_{who}_"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"), TRITON_CACHE_DIR=str(work / "triton"))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1", PYTHONUNBUFFERED="1")
    paths = [str(HERE.parent / "src"), str(HERE)]
    if who == "unsloth" and os.environ.get("UNSLOTH_SITE"):  # Unsloth's wheels only on its own process's path
        paths.append(os.environ["UNSLOTH_SITE"])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = work / "record.json"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        who,
        "--case",
        case.name,
        "--model-dir",
        str(model_dir),
        "--json",
        str(out),
        "--run-steps",
        str(args.run_steps),
        "--timed-steps",
        str(args.timed_steps),
    ]
    command += ["--smoke"] if args.smoke else []  # fmt: skip
    print(f"=== {case.name} / {who}", flush=True)
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, cwd=work, timeout=args.timeout, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        failure = None if out.exists() else f"exit {proc.returncode} without a record: {tail(log)}"
    except subprocess.TimeoutExpired as error:
        log = (error.stdout or b"").decode(errors="replace") + (error.stderr or b"").decode(errors="replace")
        failure = f"timeout after {args.timeout} s: {tail(log)}"
    print(log[-args.log_chars :] if args.log_chars else "", flush=True)
    rec = json.loads(out.read_text()) if failure is None else {"status": "failed", "reason": failure}
    rec.update(case=case.name, provider=who, wall_s=time.perf_counter() - started)
    shutil.rmtree(work, ignore_errors=True)
    verdict = rec["status"] if rec["status"] != "ok" or who == "prepare" else f"{rec['summary']['p50']:.1f} ms/step"
    print(f"=== {case.name} / {who}: {verdict} {rec.get('reason', '')[:300]} ({rec['wall_s']:.0f} s)", flush=True)
    return rec


def tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])[-600:]


class Weights:
    """The saved random-init model of the case being run, kept for the next case of the same shape (the Llama
    cases share one) and removed when the shape changes or the run ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.key, self.dir, self.ready = args, None, None, None

    def for_case(self, case: Case) -> tuple[Path, dict]:
        key = json.dumps([case.cls, case.fields], sort_keys=True)
        if key != self.key:
            self.close()
            self.key, self.dir = key, Path(tempfile.mkdtemp(prefix="vs_unsloth_model_"))
            self.ready = spawn(case, "prepare", self.dir, self.args)
        return self.dir, self.ready

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.key = self.dir = None


def run_case(case: Case, providers: list[str], weights: Weights, args: argparse.Namespace) -> list[dict]:
    model_dir, ready = weights.for_case(case)
    if ready["status"] != "ok":
        return [dict(ready, provider=p, reason=f"model not built: {ready['reason']}") for p in providers]
    return [skipped(case, p, args) or spawn(case, p, model_dir, args) for p in providers]


def skipped(case: Case, provider: str, args: argparse.Namespace) -> dict | None:
    if provider == "unsloth" and args.smoke:
        return {"case": case.name, "provider": provider, "status": "skipped", "reason": "Unsloth needs CUDA"}
    return None


def rows_of(recs: list[dict], all_cases: dict[str, Case]) -> list[Any]:
    """Long-format rows (one per metric) of every record; a failed or skipped provider is one row with its reason."""
    from _harness import Row

    stock = {r["case"]: r for r in recs if r["provider"] == "stock" and r["status"] == "ok"}
    device = next((r["device"] for r in recs if r.get("device")), "unknown")
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")  # one date for the run's rows
    versions = next((r["versions"] for r in recs if r.get("versions")), {})
    rows = []
    for r in recs:
        case = all_cases[r["case"]]
        config = {**dataclasses.asdict(case), "status": r["status"], "reason": r.get("reason", "")}
        common = dict(device=r.get("device", device), versions=r.get("versions", versions), date=date)
        if r["status"] != "ok":
            rows.append(Row(NAME, r["provider"], case.name, "status", "", "case", case.name, math.nan, config=config,
                            **common))  # fmt: skip
            continue
        sm = r["summary"]
        base = stock.get(case.name)
        keys = ("first_step_s", "cold_start_s", "to_last_step_s", "background", "graphs_total",
                "graphs_after_first_step", "import_s", "build_s",
                "patch_s", "train_s", "trainable", "extra", "args")  # fmt: skip
        config |= {k: r.get(k) for k in keys}
        config |= {"losses": r["losses"], "report": r.get("report"), "parts_ms": sm["parts"]}
        config |= {"real_tokens": [st["tokens"] for st in r["steps"]],
                   "padded_tokens": [st.get("padded_tokens") for st in r["steps"]],
                   "peak_so_far_gib": [st.get("peak_so_far_gib") for st in r["steps"]],
                   "step_peak_gib": [st.get("step_peak_gib") for st in r["steps"]]}  # fmt: skip
        if base is not None:
            pairs = [(a, b) for a, b in zip(r["losses"], base["losses"]) if a is not None and b is not None]
            config["max_abs_loss_diff_vs_stock"] = max((abs(a - b) for a, b in pairs), default=None)
        metric = [("speed", "ms", sm["p50"], sm["p20"], sm["p80"]), ("memory", "GiB", r["peak_gib"], None, None),
                  ("first step", "s", r["first_step_s"], None, None),
                  ("cold start", "s", r["cold_start_s"], None, None),
                  ("tokens per s", "tokens/s", sm["tokens_per_s"], None, None),
                  ("recompiles", "graphs", r["graphs_after_first_step"], None, None)]  # fmt: skip
        for name, unit, p50, p20, p80 in metric:
            value = math.nan if p50 is None else float(p50)
            rows.append(Row(NAME, r["provider"], case.name, name, unit, "case", case.name, value, p20, p80,
                            config=config if name == "speed" else {"status": "ok"}, **common))  # fmt: skip
    return rows


def table(rows: list[Any], order: list[str]) -> str:
    """One line per case, one column per provider: step ms (x stock), peak GiB, first step s; the varlen case in
    tokens/s (x stock) and its recompiles; failures with their reason."""
    from _harness import markdown_table

    by = {(r.mode, r.provider, r.metric): r for r in rows}
    providers = [p for p in PROVIDERS + OPT_IN if any(r.provider == p for r in rows)]
    lines = []
    for case in order:
        cells = []
        stock = by.get((case, "stock", "speed"))
        stock_tps = by.get((case, "stock", "tokens per s"))
        for p in providers:
            status = by.get((case, p, "status"))
            speed = by.get((case, p, "speed"))
            if status is not None:
                reason = " ".join(status.config["reason"].replace("|", "/").split())[:160]
                cells.append(f"{status.config['status']}: {reason}")
            elif speed is None:
                cells.append("–")
            elif case.endswith("varlen"):
                tps, rec = by[(case, p, "tokens per s")].p50, by[(case, p, "recompiles")].p50
                ratio = f" ({tps / stock_tps.p50:.2f}x)" if stock_tps else ""
                cells.append(f"{tps:.0f} tok/s{ratio}, {by[(case, p, 'memory')].p50:.2f} GiB, "
                             f"{rec:.0f} graphs after step 1")  # fmt: skip
            else:
                ratio = f" ({stock.p50 / speed.p50:.2f}x)" if stock else ""
                cells.append(f"{speed.p50:.1f} ms{ratio}, {by[(case, p, 'memory')].p50:.2f} GiB, first step "
                             f"{by[(case, p, 'first step')].p50:.1f} s (cold start "
                             f"{by[(case, p, 'cold start')].p50:.0f} s)")  # fmt: skip
        lines.append([case, *cells])
    loss = ["max abs loss diff vs stock (per-step losses)"]
    for p in providers:
        diffs = [r.config.get("max_abs_loss_diff_vs_stock") for r in rows if r.provider == p and r.metric == "speed"]
        diffs = [d for d in diffs if d is not None]
        loss.append(f"{max(diffs):.3g}" if diffs else "–")
    return markdown_table(["case", *providers], [*lines, loss, unlike_stock(rows, providers)])


def latest(rows: list[Any]) -> list[Any]:
    """The rows of each (case, provider) from its latest run, each row once (``_harness.latest_runs``)."""
    from _harness import latest_runs

    return latest_runs(rows)


def write(recs: list[dict], args: argparse.Namespace, extra_rows: list[Any] = ()) -> Path:
    """Rows of ``recs`` (and ``extra_rows``: rows of earlier runs, e.g. other device calls) over those already in
    the results directory, each (case, provider) from its latest run; then the table and the plot."""
    from _harness import RESULTS, previous_rows, write_results

    all_cases = cases(args.smoke, getattr(args, "timed_steps", 0))
    out_dir = Path(args.out or os.environ.get("BENCH_RESULTS", RESULTS))
    new = [*extra_rows, *rows_of(recs, all_cases)]
    done = {(r.mode, r.provider) for r in new}
    kept = [r for r in previous_rows(NAME, out_dir, args.smoke) if (r.mode, r.provider) not in done]
    rows = kept + latest(new)
    order = [c for c in all_cases if any(r.mode == c for r in rows)]
    text = table(rows, order)
    header = ("Each (case, provider) in its own process, cold caches. Cells: median step (speed-up over stock), "
              "peak allocated GiB over training (weights included), first step (cold start: from the process's "
              "first import to the end of the first step, loading and compiling included). Full records (per-step "
              "losses, leantrain's report, timings) in the JSON.\n\n")  # fmt: skip
    header += told(rows, order)
    unsloth = next((r.versions for r in rows if "unsloth" in r.versions), None)
    if unsloth:
        header += f"Unsloth {unsloth['unsloth']}, unsloth_zoo {unsloth.get('unsloth_zoo', '?')}.\n\n"
    out = write_results(NAME, rows, header + text, out_dir)
    try:
        plot(rows, order, out / f"{NAME}.png")
    except Exception as error:  # the rows and table are the result; a plot failure must not lose them
        print(f"plot failed: {error}")
    print(text)
    return out


def write_rounds(paths: list[str], case: str, args: argparse.Namespace) -> Path:
    """``<name>_rounds_<case>``: the case's rows from several runs (e.g. the same providers in alternating order, each
    run a round), a line per (round, provider) in run order; the rows keep their round in ``config``."""
    from _harness import markdown_table, read_rows, write_results

    rows, lines = [], []
    for k, path in enumerate(paths, 1):
        mine = [r for r in latest(read_rows(Path(path))) if r.mode == case]
        if not mine:
            raise SystemExit(f"{path} has no rows of {case}")
        mine = [r for r in mine if r.date == max(r.date for r in mine)]  # not the earlier runs a results file keeps
        mine.sort(key=lambda r: r.date)
        for r in mine:
            r.config = {**r.config, "round": k, "source": Path(path).name}
        by = {(r.provider, r.metric): r for r in mine}
        for provider in dict.fromkeys(r.provider for r in mine if r.metric in ("speed", "status")):
            speed = by.get((provider, "speed"))
            if speed is None:
                lines.append([k, provider, by[(provider, "status")].config.get("reason", "")[:120], "–", "–", "–"])
                continue
            memory, first = by[(provider, "memory")].p50, by[(provider, "first step")].p50
            cells = f"{speed.p50:.1f} ({speed.p20:.1f}-{speed.p80:.1f})", f"{memory:.3f}", f"{first:.1f}"
            lines.append([k, provider, *cells, whole_run(speed.config)])
        rows += mine
    header = ["round", "provider", "median step ms (p20-p80)", "peak alloc GiB", "first step s", WHOLE_RUN]
    text = markdown_table(header, lines)
    text += f"\n\n{case}: each round a run of bench_vs_unsloth.py (one process per provider, in the order listed). "
    text += told(rows, [case]).rstrip() + "\n"  # what the rows' trainers were told, not this file's default
    out = write_results(f"{NAME}_rounds_{case}", rows, text, Path(args.out) if args.out else None)
    print(text)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Unsloth skipped)")
    parser.add_argument("--cases", default="", help=f"comma-separated (default: {','.join(DEFAULT_CASES)})")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per provider process")
    parser.add_argument(
        "--run-steps", type=int, default=RUN_STEPS, help="the run length every trainer is told (timing stops earlier)"
    )
    parser.add_argument(
        "--timed-steps", type=int, default=0, help="timed steps of every case instead of its own (0: the case's)"
    )
    parser.add_argument("--out", default="", help="results directory (default $BENCH_RESULTS or benchmarks/results)")
    parser.add_argument("--log-chars", type=int, default=4000, help="tail of each worker's log to print")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=[],
        help="vs_unsloth.json files of several runs (e.g. device "
        "calls) to join into --out; a (case, provider) in several keeps its latest",
    )
    rounds_help = "vs_unsloth.json files of runs of one case (--cases), each a round: a table of all into --out"
    parser.add_argument("--rounds", nargs="+", default=[], help=rounds_help)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.rounds:
        if len([c for c in args.cases.split(",") if c]) != 1:
            raise SystemExit("--rounds takes one case: --cases NAME")
        write_rounds(args.rounds, args.cases, args)
        return None
    if args.merge:
        from _harness import read_rows

        write([], args, [row for path in args.merge for row in read_rows(Path(path))])
        return None
    if args.timed_steps < 0:
        raise SystemExit(f"--timed-steps must be >= 0, got {args.timed_steps}")
    known = cases(args.smoke, args.timed_steps)
    wanted = [c for c in args.cases.split(",") if c] or [c for c in DEFAULT_CASES if c in known] or list(known)
    providers = [p for p in args.providers.split(",") if p]
    unknown = [c for c in wanted if c not in known] + [p for p in providers if p not in PROVIDERS + OPT_IN]
    if unknown:
        raise SystemExit(f"unknown {unknown}: cases {list(known)}, providers {list(PROVIDERS + OPT_IN)}")
    recs: list[dict] = []
    weights = Weights(args)
    try:
        for name in wanted:
            recs += run_case(known[name], providers, weights, args)
            write(recs, args)  # after each case: a run cut off at its limit keeps what finished
    finally:
        weights.close()
    bad = [r for r in recs if r["provider"] in ("stock", "leantrain") and r["status"] not in ("ok", "skipped")]
    if bad:
        raise SystemExit(f"{len(bad)} stock/leantrain runs failed: " + "; ".join(r["reason"][:200] for r in bad))


if __name__ == "__main__":
    main()
