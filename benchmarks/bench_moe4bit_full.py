"""Whole MoE QLoRA models under a memory cap: gpt-oss-20b (24 layers, 32 experts, top-4) and Qwen3-30B-A3B
(48 layers, 128 experts, top-8) shaped models, random weights, TRL ``SFTTrainer`` steps with gradient checkpointing.

Build: the model on the meta device, then one decoder layer at a time on the GPU
(``recipes.moe_qlora.build_layerwise``: seeded by parameter name, quantized before the next layer exists, so the
bf16 model is never whole): the attention projections as bitsandbytes nf4 ``Linear4bit`` with double quantization
and bf16 compute (what ``BitsAndBytesConfig(load_in_4bit, nf4, double quant)`` makes of them: transformers 5.x
bitsandbytes quantizes ``nn.Linear`` only, and in both families the only ``nn.Linear`` of a decoder layer are
q/k/v/o), and

- ``leantrain``: the 3-D expert stacks as nf4 stacks with double quantization (``leantrain.quantize_experts_4bit``)
  and ``leantrain.patch_trainer(trainer, moe4bit=True)``;
- ``stock``: the 3-D expert stacks left bf16 (what BitsAndBytesConfig does to them), no patch. Under a 16 or 24 GiB
  cap its bf16 experts alone are over the cap (the table says so from their size, not run); it runs uncapped.

``model.is_loaded_in_4bit`` is set as a BitsAndBytesConfig load sets it, so TRL casts the adapters to bf16 (QLoRA).
LoRA (PEFT, alpha 2r, no dropout) on q/k/v/o (``target_modules``), or on q/k/v/o and both expert stacks (PEFT
``target_parameters``: ``leantrain.expert_lora_targets`` names the 4-bit stacks, stock names the bf16 ones). A rank
written ``<=16`` is the largest rank up to 16 whose weights + adapters + gradients + optimizer state + 1.5 GiB fit the
cap (the arithmetic is printed and stored). Optimizers: ``adamw_torch`` and ``adamw_8bit`` (bitsandbytes AdamW8bit).
Batch 1 x 2048 and 1 x 4096 tokens; 2 warm-up + 3 timed optimizer steps. The "Unsloth notebook" run is the
configuration of Unsloth's published gpt-oss-20b figure (see ``UNSLOTH``).

Each run is its own process (an OOM cannot poison the next) under ``torch.cuda.set_per_process_memory_fraction``
emulating a card of ``cap_gib`` (it caps what PyTorch's allocator reserves; a real card also holds the CUDA context,
~0.5 GiB, outside it). Memory: weights at
rest = allocated after the build; adapters + optimizer state = allocated at the end of the first optimizer step
(gradients freed) minus the weights; transient = peak allocated during the steps minus both (gradients included).
A smaller card is judged from the run: it fits if the run never reserved more than it (the cap then never acts),
it does not if the run's peak allocated is above it; otherwise it is re-run under that cap while time is left.

    python benchmarks/bench_moe4bit_full.py --shape gpt-oss-20b --budget-s 330    # CUDA: one shape's runs
    python benchmarks/bench_moe4bit_full.py --list                              # the runs, nothing executed
    python benchmarks/bench_moe4bit_full.py --smoke                             # CPU, tiny shapes
    python benchmarks/bench_moe4bit_full.py --report a.json b.json              # merge runs into one table

Writes ``moe4bit_full_depth.json`` (the rows already in ``$BENCH_RESULTS``, else ``benchmarks/results/``, with the
runs just made replaced), ``.md`` and ``.png`` (peak split per run, stacked, the 16 / 24 GiB caps as lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _harness import RESULTS, Row, markdown_table, previous_rows, read_rows, write_results  # noqa: E402
from recipes import settings as recipe_settings  # noqa: E402


NAME = "moe4bit_full_depth"
GIB = 2**30
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
STOCK_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
CAPS = (16.0, 20.0, 24.0)  # consumer cards (16, 24 GiB) and the 20 GiB target for Qwen3-30B-A3B attention LoRA
RESERVE_GIB = 1.5  # transient allowance when a rank is chosen to fit a cap (the transient target)
WARMUP, TIMED = 2, 3
SHAPES = {  # shape -> (transformers config class, full fields, smoke fields)
    "gpt-oss-20b": ("GptOssConfig", recipe_settings.GPT_OSS_20B, recipe_settings.TINY_GPT_OSS),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", recipe_settings.QWEN3_30B_A3B, recipe_settings.TINY_QWEN3_MOE),
}
# Unsloth's gpt-oss-20b notebook (unslothai/notebooks, nb/gpt-oss-(20B)-Fine-tuning.ipynb, commit 03b0cdad, read
# 2026-11-25): load_in_4bit, max_seq_length 1024, get_peft_model(r=8, lora_alpha=16, lora_dropout=0, target_modules=
# [q,k,v,o,gate,up,down]_proj, use_gradient_checkpointing="unsloth"), SFTConfig(per_device_train_batch_size=1,
# gradient_accumulation_steps=4, optim="adamw_8bit", learning_rate=2e-4, weight_decay=0.001); its log: "Trainable
# parameters = 3,981,312" (r8 on q/k/v/o of 24 layers: gpt-oss has no gate/up/down_proj modules) and on a Tesla T4
# "12.811 GB of memory reserved" before training, "Peak reserved memory = 12.975 GB" (torch max_memory_reserved /
# 1024**3). Its rows are up to 1024 tokens; here every row is 1024 tokens. The run names q/k/v/o, what the list
# trains in gpt-oss: on quantize_experts_4bit stacks "down_proj" would also match the stack's parametrization module
# (``experts.parametrizations.down_proj``), which PEFT rejects ("Target module ParametrizationList ... not supported").
UNSLOTH = dict(
    source="unslothai/notebooks nb/gpt-oss-(20B)-Fine-tuning.ipynb at 03b0cdad",
    rank=8,
    alpha=16,
    listed=(*ATTENTION, "gate_proj", "up_proj", "down_proj"),
    targets=ATTENTION,
    optim="adamw_8bit",
    seq=1024,
    grad_accum=4,
    weight_decay=0.001,
    trainable=3_981_312,
    reserved_gib=12.811,
    peak_reserved_gib=12.975,
)


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    shape: str
    provider: str  # stock / leantrain
    seq: int
    cap_gib: float | None  # None: uncapped (the whole card)
    placement: str  # attention / attention+experts
    rank: int
    optim: str  # adamw_torch / adamw_8bit
    fit_rank: bool = False  # rank = the largest <= ``rank`` that fits the cap
    alpha: int | None = None  # default 2 * rank
    grad_accum: int = 1
    targets: tuple[str, ...] = ATTENTION
    weight_decay: float = 0.0

    @property
    def key(self) -> tuple:
        return (self.shape, self.name, self.seq, self.cap_gib)


def plan(shape: str, smoke: bool = False) -> list[Run]:
    """The runs of one shape in priority order (a time budget drops the tail)."""
    short, long = (32, 64) if smoke else (2048, 4096)

    def run(name, provider, seq, cap, placement, optim, **kw) -> Run:
        return Run(name, shape, provider, seq, cap, placement, kw.pop("rank", 16), optim, **kw)

    experts = dict(rank=16, fit_rank=True)
    runs = [
        run("attn r16 adamw_8bit", "leantrain", short, 24.0, "attention", "adamw_8bit"),
        run("attn+experts r<=16 adamw_8bit", "leantrain", short, 24.0, "attention+experts", "adamw_8bit", **experts),
        run("attn r16 adamw", "leantrain", short, 24.0, "attention", "adamw_torch"),
        run("attn+experts r<=16 adamw", "leantrain", short, 24.0, "attention+experts", "adamw_torch", **experts),
        run("stock attn r16 adamw_8bit", "stock", short, 24.0, "attention", "adamw_8bit"),  # recorded: over the cap
        run("stock attn r16 adamw_8bit", "stock", short, None, "attention", "adamw_8bit"),
        run("attn r16 adamw_8bit", "leantrain", long, 24.0, "attention", "adamw_8bit"),
        run("attn+experts r<=16 adamw_8bit", "leantrain", long, 24.0, "attention+experts", "adamw_8bit", **experts),
        run("stock attn+experts r16 adamw_8bit", "stock", short, None, "attention+experts", "adamw_8bit"),
    ]
    if shape == "gpt-oss-20b":
        unsloth = run(
            "Unsloth notebook config", "leantrain", 16 if smoke else UNSLOTH["seq"], 16.0, "attention",
            UNSLOTH["optim"], rank=UNSLOTH["rank"], alpha=UNSLOTH["alpha"], grad_accum=UNSLOTH["grad_accum"],
            targets=UNSLOTH["targets"], weight_decay=UNSLOTH["weight_decay"],
        )  # fmt: skip
        runs.insert(1, unsloth)
    return runs


# -- arithmetic ----------------------------------------------------------------------------------------------------


def state_bytes(optim: str, param_bytes: int) -> float:
    """Optimizer state bytes per trainable value: torch AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype;
    bitsandbytes AdamW8bit keeps both as uint8 plus one fp32 absmax per 256 values each (tensors of 4096+ values)."""
    return 2 * param_bytes if optim == "adamw_torch" else 2 + 2 * 4 / 256


def choose_rank(max_rank: int, per_rank: int, weights: float, cap: float, per_value: float, reserve: float) -> int:
    """The largest rank <= ``max_rank`` with ``weights + rank * per_rank * per_value + reserve <= cap`` (bytes);
    0 when not even rank 1 fits."""
    for rank in range(max_rank, 0, -1):
        if weights + rank * per_rank * per_value + reserve <= cap:
            return rank
    return 0


def fits(cap: float, result: dict) -> str:
    """Whether a card of ``cap`` GiB holds a finished run: the run under ``cap`` itself, never reserving more (the
    cap would not have acted), or allocating more at its peak (it cannot)."""
    if result.get("status") != "ok":
        return "-"
    if not math.isfinite(result.get("max_reserved_gib", math.nan)):
        return "n/a (no CUDA)"
    if result.get("cap_gib") is not None and result["cap_gib"] <= cap:
        return "yes (ran under it)"
    if result["max_reserved_gib"] <= cap:
        return f"yes (reserved <= {result['max_reserved_gib']:.1f})"
    if result["max_allocated_gib"] > cap:
        return f"no (needs {result['max_allocated_gib']:.1f})"
    return "unknown (re-run under it)"


def arithmetic(trainable: int, param_bytes: int, optim: str) -> dict[str, float]:
    """What the trainable values cost, in GiB: as trained here, and the issue's fp32 AdamW estimate (16 B/value)."""
    state = state_bytes(optim, param_bytes)
    return dict(
        adapters_gib=trainable * param_bytes / GIB,
        grads_gib=trainable * param_bytes / GIB,
        optimizer_state_gib=trainable * state / GIB,
        fp32_adamw_gib=trainable * 16 / GIB,
        bytes_per_value=2 * param_bytes + state,
    )


# -- one run (child process) ---------------------------------------------------------------------------------------


def settings_for(smoke: bool):
    if smoke or not torch.cuda.is_available():
        return recipe_settings.SMOKE
    return recipe_settings.FULL


def build(run: Run, s) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model, layer by layer on the device (never whole in bf16), attention nf4, experts per the provider."""
    from recipes.moe_experts import linear4bit
    from recipes.moe_qlora import build_layerwise

    import leantrain

    cls, full, tiny = SHAPES[run.shape]
    quantize = run.provider == "leantrain"

    def transform(layer: torch.nn.Module) -> None:
        for name in ATTENTION:
            setattr(layer.self_attn, name, linear4bit(getattr(layer.self_attn, name), s.dtype))
        if quantize:
            leantrain.quantize_experts_4bit(layer, compress_statistics=True)

    layout = "nf4 stacks (quantize_experts_4bit, double quant)" if quantize else "bf16 3-D stacks"
    model, info = build_layerwise(cls, tiny if s is recipe_settings.SMOKE else full, transform, layout, s)
    model.is_loaded_in_4bit = True  # as a BitsAndBytesConfig load marks it: TRL then casts the adapters to bf16
    info["experts"] = describe_experts(model)
    return model, info


def describe_experts(model: torch.nn.Module) -> str:
    """Which expert layout this transformers has: the experts class, its stacks' shape and storage."""
    from torch.nn.utils import parametrize

    for module in model.modules():
        if "gate_up_proj" in getattr(module, "_parameters", {}) or parametrize.is_parametrized(module, "gate_up_proj"):
            if parametrize.is_parametrized(module, "gate_up_proj"):
                state = module.parametrizations["gate_up_proj"][0].quant_state
                shape, storage = tuple(state.shape), f"{state.quant_type} packed"
            else:
                shape, storage = tuple(module._parameters["gate_up_proj"].shape), str(module.gate_up_proj.dtype)
            return f"{type(module).__name__} 3-D gate_up_proj {list(shape)} {storage}"
    return "no 3-D experts found"


def per_rank_values(model: torch.nn.Module, run: Run) -> int:
    """Trainable values per unit of LoRA rank: in + out features of every targeted linear; per expert stack
    E * (in + out) (PEFT's target_parameters factors hold r per expert)."""
    total = sum(
        m.in_features + m.out_features
        for n, m in model.named_modules()
        if n.rpartition(".")[2] in run.targets and hasattr(m, "in_features")
    )
    if run.placement == "attention+experts":
        c = model.config
        experts = getattr(c, "num_local_experts", None) or c.num_experts
        inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        total += c.num_hidden_layers * experts * (2 * c.hidden_size + 3 * inter)
    return total


class StepMemory:
    """Per optimizer step: wall time (CUDA-synchronized), peak allocated / reserved, allocated at its end."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.steps: list[dict[str, float]] = []
        self.before = {"max_allocated_gib": 0.0, "max_reserved_gib": 0.0}
        self.t0 = 0.0

    def callback(self):
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                if outer.cuda:
                    outer.before = {
                        "max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                        "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
                    }

            def on_step_begin(self, args, state, control, **kwargs):
                if outer.cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                outer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                step = {"ms": 0.0, "peak_gib": math.nan, "reserved_gib": math.nan, "end_gib": math.nan}
                if outer.cuda:
                    torch.cuda.synchronize()
                    step.update(
                        peak_gib=torch.cuda.max_memory_allocated() / GIB,
                        reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                        end_gib=torch.cuda.memory_allocated() / GIB,
                    )
                step["ms"] = (time.perf_counter() - outer.t0) * 1e3
                outer.steps.append(step)

        return Callback()


def allocated_gib(cuda: bool) -> float:
    if not cuda:
        return math.nan
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / GIB


def train(run: Run, s, out: dict[str, Any], clock: StepMemory) -> None:
    """Build, attach LoRA, patch (leantrain), train; fills ``out`` as it goes (an exception leaves what was known)."""
    from recipes.runner import ONLY, checkpointing, sft_trainer, token_dataset

    import leantrain

    out["phase"] = "build"
    model, info = build(run, s)
    out.update(build_s=info["build_model_s"], layout=info["layout"], experts=info["experts"])
    out.update(experts_implementation=info["experts_implementation"], attention=info["attention"])
    out["weights_gib"] = allocated_gib(s.cuda)
    out["build_peak_gib"] = torch.cuda.max_memory_allocated() / GIB if s.cuda else math.nan
    per_rank = per_rank_values(model, run)
    rank = run.rank
    param_bytes = 2  # TRL casts QLoRA adapters to bf16
    per_value = 2 * param_bytes + state_bytes(run.optim, param_bytes)
    if run.fit_rank and run.cap_gib is not None and s.cuda:
        weights = out["weights_gib"] * GIB
        rank = choose_rank(run.rank, per_rank, weights, run.cap_gib * GIB, per_value, RESERVE_GIB * GIB)
    out.update(rank=rank, per_rank_values=per_rank, planned=arithmetic(rank * per_rank, param_bytes, run.optim))
    print(f"[{run.name}] LoRA values per rank {per_rank:,}; rank {rank}: {rank * per_rank:,} trainable; "
          f"{per_value:.2f} B per value (bf16 adapter + gradient + {run.optim} state) = "
          f"{rank * per_rank * per_value / GIB:.2f} GiB; fp32 AdamW (16 B/value) would be "
          f"{rank * per_rank * 16 / GIB:.2f} GiB; weights at rest {out['weights_gib']:.2f} GiB",
          flush=True)  # fmt: skip
    if rank == 0:
        raise RuntimeError(f"no LoRA rank fits {run.cap_gib} GiB next to {out['weights_gib']:.2f} GiB of weights")
    out["phase"] = "trainer"
    lora = lora_config(run, model, rank)
    steps = WARMUP + TIMED
    vocab = SHAPES[run.shape][2 if s is recipe_settings.SMOKE else 1]["vocab_size"]
    data = token_dataset(vocab, steps * run.grad_accum, run.seq)
    tmp = tempfile.mkdtemp(prefix="moe4bit_full_")
    trainer = sft_trainer(
        model, data, Path(tmp), steps, s, peft_config=lora, learning_rate=2e-4, per_device_train_batch_size=1,
        gradient_accumulation_steps=run.grad_accum, max_length=run.seq, optim=run.optim,
        weight_decay=run.weight_decay, **checkpointing(True),
    )  # fmt: skip
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    out["trainable"] = sum(p.numel() for p in trainable)
    out["adapter_dtype"] = str(trainable[0].dtype).replace("torch.", "") if trainable else "-"
    out["expert_adapter_values"] = sum(
        p.numel() for n, p in trainer.model.named_parameters() if p.requires_grad and ".experts." in n
    )
    out["arithmetic_matches_model"] = out["trainable"] == rank * per_rank
    out["after_lora_gib"] = allocated_gib(s.cuda)
    if run.placement == "attention+experts" and out["expert_adapter_values"] == 0:
        raise LookupError("PEFT made no expert adapters (target_parameters matched nothing): not measured")
    if run.provider == "leantrain":
        out["phase"] = "patch"
        t0 = time.perf_counter()
        report = leantrain.patch_trainer(trainer, **{**ONLY, "moe4bit": True})
        out["patch_s"] = time.perf_counter() - t0
        outcome = report["moe4bit"]
        out["moe4bit"] = f"{outcome.status.value}: {outcome.detail or '; '.join(outcome.reasons)}"[:400]
        out["after_patch_gib"] = allocated_gib(s.cuda)
        print(report, flush=True)
    trainer.add_callback(clock.callback())
    out["phase"] = "train"
    t0 = time.perf_counter()
    trainer.train()
    out["train_s"] = time.perf_counter() - t0
    out["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]


def lora_config(run: Run, model: torch.nn.Module, rank: int):
    from peft import LoraConfig

    import leantrain

    config = dict(
        r=rank,
        lora_alpha=run.alpha or 2 * rank,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=list(run.targets),
    )
    if run.placement == "attention+experts":
        stacks = leantrain.expert_lora_targets(model) if run.provider == "leantrain" else list(STOCK_EXPERTS)
        config["target_parameters"] = stacks
    return LoraConfig(**config)


def warm_up(run: Run, cuda: bool) -> None:
    """Imports and the CUDA context before the build clock starts (the build time is the build's own)."""
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import transformers
    import trl  # noqa: F401

    config = getattr(transformers, SHAPES[run.shape][0])
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config(num_hidden_layers=1, vocab_size=64))
    if cuda:
        torch.zeros(1, device="cuda")


def run_one(run: Run, smoke: bool) -> dict[str, Any]:
    """One run in this process: the result dict (status ok / oom / failed / not measured / not served, memory split,
    times)."""
    import leantrain

    s = settings_for(smoke)
    out: dict[str, Any] = {"status": "ok", "run": dataclasses.asdict(run), "device_gib": None}
    if s.cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        out["device_gib"] = total / GIB
        if run.cap_gib is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, run.cap_gib * GIB / total))
    clock = StepMemory(s.cuda)
    warm_up(run, s.cuda)
    try:
        train(run, s, out, clock)
    except torch.OutOfMemoryError as error:
        out.update(status="oom", reason=f"{out['phase']}: {str(error).splitlines()[0][:240]}")
    except LookupError as error:
        out.update(status="not measured", reason=str(error))
    except leantrain.NotReadyError as error:
        out.update(status="not served", reason=str(error)[:400])
    except Exception as error:  # recorded; the parent marks the run failed
        traceback.print_exc()
        out.update(status="failed", reason=f"{out['phase']}: {type(error).__name__}: {error}"[:400])
    if out["status"] == "ok" and len(clock.steps) != WARMUP + TIMED:
        out.update(status="failed", reason=f"expected {WARMUP + TIMED} steps, saw {len(clock.steps)}")
    out["steps"] = clock.steps
    summarize(out, clock, s.cuda)
    return out


def summarize(out: dict[str, Any], clock: StepMemory, cuda: bool) -> None:
    peaks = [st["peak_gib"] for st in clock.steps]
    reserved = [st["reserved_gib"] for st in clock.steps]
    out["max_allocated_gib"] = max([clock.before["max_allocated_gib"], *peaks]) if cuda else math.nan
    out["max_reserved_gib"] = max([clock.before["max_reserved_gib"], *reserved]) if cuda else math.nan
    if cuda and out["status"] != "ok":  # what the process held when it stopped
        out["max_allocated_gib"] = max(out["max_allocated_gib"], torch.cuda.max_memory_allocated() / GIB)
        out["max_reserved_gib"] = max(out["max_reserved_gib"], torch.cuda.max_memory_reserved() / GIB)
    if out["status"] != "ok":
        return
    timed = sorted(st["ms"] for st in clock.steps[WARMUP:])
    out["ms"] = timed[len(timed) // 2]
    out["ms_min"], out["ms_max"] = timed[0], timed[-1]
    out["peak_gib"] = max(peaks)
    resting = clock.steps[0]["end_gib"]  # weights + adapters + optimizer state (gradients freed by zero_grad)
    out["adapters_opt_gib"] = resting - out["weights_gib"]
    out["transient_gib"] = out["peak_gib"] - resting
    if "after_patch_gib" in out:  # of adapters + optimizer: what patch_trainer keeps (the grouped path's plan)
        out["plan_gib"] = out["after_patch_gib"] - out["after_lora_gib"]


# -- the parent: runs, rows, table, plot ----------------------------------------------------------------------------


def child(run: Run, smoke: bool, timeout: float) -> dict[str, Any]:
    """``run`` in a fresh process; a crash or timeout is a result too."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--one", json.dumps(dataclasses.asdict(run)), "--out", str(path)]
        cmd += ["--smoke"] if smoke else []
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as error:
            log = f"{error.stdout or ''}{error.stderr or ''}"
            proc = None
        wall = time.perf_counter() - t0
        print(log[-3000:], flush=True)
        if path.exists():
            result = json.loads(path.read_text())
        else:
            why = "timed out" if proc is None else f"exit code {proc.returncode}"
            tail = log.strip().splitlines()[-1:] or [""]
            result = {"status": "failed", "run": dataclasses.asdict(run), "reason": f"process {why}: {tail[0][:300]}"}
    result["wall_s"] = wall
    return result


def not_run(run: Run, reason: str) -> dict[str, Any]:
    return {"status": "not run", "run": dataclasses.asdict(run), "reason": reason}


def stock_over_cap(run: Run, smoke: bool) -> str | None:
    """Why a stock run under a cap is not run: its bf16 expert stacks alone (2 bytes a value) exceed the cap."""
    if run.provider != "stock" or run.cap_gib is None:
        return None
    c = SHAPES[run.shape][2 if smoke else 1]
    experts = c.get("num_local_experts") or c["num_experts"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    values = c["num_hidden_layers"] * experts * 3 * inter * c["hidden_size"]
    gib = values * 2 / GIB
    if gib <= run.cap_gib:
        return None
    return f"bf16 expert stacks alone {gib:.1f} GiB ({values / 1e9:.2f}B values x 2 bytes) > {run.cap_gib:g} GiB"


def execute(runs: list[Run], smoke: bool, budget_s: float, write) -> list[dict[str, Any]]:
    """Run in order while the budget holds (estimate: the longest run so far); then re-run under a smaller cap the
    runs whose fit there is unknown, as far as the budget goes. ``write(results)`` after every run."""
    start, longest, results = time.perf_counter(), 60.0, []
    queue = list(runs)
    while queue:
        run = queue.pop(0)
        left = budget_s - (time.perf_counter() - start)
        if (reason := stock_over_cap(run, smoke)) is not None:
            results.append(not_run(run, reason))
        elif left < longest:
            why = f"time budget ({budget_s:.0f} s): {left:.0f} s left, a run takes ~{longest:.0f} s"
            results.append(not_run(run, why))
        else:
            result = child(run, smoke, timeout=max(30.0, left))
            longest = max(longest, result["wall_s"])
            results.append(result)
            unknown = [cap for cap in CAPS if fits(cap, flat(result)).startswith("unknown")]
            if unknown and run.provider == "leantrain":  # the largest first: its result may settle the others
                queue.append(dataclasses.replace(run, cap_gib=max(unknown)))
        write(results)
    return results


def flat(result: dict[str, Any]) -> dict[str, Any]:
    return {**result, "cap_gib": result["run"]["cap_gib"]}


def to_rows(result: dict[str, Any]) -> list[Row]:
    run = Run(**{**result["run"], "targets": tuple(result["run"]["targets"])})
    keep = {k: v for k, v in result.items() if k not in ("run", "steps")}
    config = {
        **dataclasses.asdict(run),
        **keep,
        "shape": run.shape,
        "cap_gib": run.cap_gib,
        "steps": result.get("steps", []),
        "fits": {f"{cap:g}": fits(cap, flat(result)) for cap in CAPS},
    }
    where = (NAME, run.provider, "train step")
    if result["status"] != "ok":
        peak = result.get("max_allocated_gib", math.nan)
        return [Row(*where, "memory", "GiB", "tokens", run.seq, peak if peak is not None else math.nan, config=config)]
    return [
        Row(*where, "memory", "GiB", "tokens", run.seq, result["peak_gib"], config=config),
        Row(*where, "speed", "ms", "tokens", run.seq, result["ms"], result["ms_min"], result["ms_max"], config=config),
    ]


def row_key(row: Row) -> tuple:
    c = row.config
    return (c["shape"], c["name"], c["seq"], c["cap_gib"], row.metric)


def merge(old: list[Row], new: list[Row]) -> list[Row]:
    """Old rows of the runs not in ``new`` (same shape, name, length, cap), then ``new``."""
    ran = {row_key(r)[:4] for r in new}
    return [r for r in old if row_key(r)[:4] not in ran] + list(new)


def gib(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def tokens(c: dict) -> str:
    ga = c.get("grad_accum", 1)
    return f"1x{c['seq']}" + (f" x{ga} accumulated" if ga > 1 else "")


def table(rows: list[Row]) -> str:
    memory = [r for r in rows if r.metric == "memory"]
    speed = {row_key(r)[:4]: r.p50 for r in rows if r.metric == "speed"}
    header = [
        "shape", "run", "tokens", "cap GiB", "status", "rank", "trainable", "weights", "adapters+opt", "transient",
        "peak", "max reserved", "ms/step", "16 GiB", "20 GiB", "24 GiB", "build s", "notes",
    ]  # fmt: skip
    body = []
    for r in memory:
        c = r.config
        ms = speed.get(row_key(r)[:4])
        note = c.get("reason") or c.get("moe4bit", "")
        body.append([
            c["shape"], c["name"], tokens(c), "none" if c["cap_gib"] is None else c["cap_gib"],
            c["status"], c.get("rank", "-"), f"{c['trainable']:,}" if c.get("trainable") else "-",
            gib(c.get("weights_gib")), gib(c.get("adapters_opt_gib")), gib(c.get("transient_gib")),
            gib(c.get("peak_gib")), gib(c.get("max_reserved_gib")), "-" if ms is None else f"{ms:.0f}",
            *(c["fits"][f"{cap:g}"] for cap in CAPS), gib(c.get("build_s")), note[:160],
        ])  # fmt: skip
    return markdown_table(header, body)


def notes(rows: list[Row]) -> str:
    """The arithmetic of the expert adapters, the layouts and the issue's targets as measured (for the reader)."""
    lines = []
    memory = [r for r in rows if r.metric == "memory"]
    for r in memory:
        c = r.config
        if c.get("planned") and c["placement"] == "attention+experts" and c["status"] == "ok":
            p = c["planned"]
            lines.append(
                f"- {c['shape']} {c['name']} at {c['seq']}: rank {c['rank']}, {c['trainable']:,} trainable values "
                f"({c['per_rank_values']:,} per rank; matches the model: {c.get('arithmetic_matches_model')}); as "
                f"trained ({c.get('adapter_dtype')} adapters, {c['optim']}): adapters {p['adapters_gib']:.2f} + "
                f"optimizer state {p['optimizer_state_gib']:.2f} GiB at rest, gradients {p['grads_gib']:.2f} GiB "
                f"in the step; fp32 AdamW (16 B/value) would hold {p['fp32_adamw_gib']:.2f} GiB. Measured adapters "
                f"+ optimizer state: {gib(c.get('adapters_opt_gib'))} GiB."
            )
    layouts = sorted({(r.config["shape"], r.config.get("experts"), r.config.get("experts_implementation"),
                       r.config.get("attention")) for r in memory if r.config.get("experts")})  # fmt: skip
    lines += [f"- {s}: experts {e} (experts implementation {i}), attention {a}" for s, e, i, a in layouts]
    u = UNSLOTH
    lines.append(
        f"- Unsloth notebook config ({u['source']}): r{u['rank']}, alpha {u['alpha']}, target_modules "
        f"{list(u['listed'])} (gate/up/down_proj match nothing in gpt-oss: run as q/k/v/o), {u['optim']}, batch 1 x "
        f"{u['grad_accum']} accumulated, max_seq_length {u['seq']} (rows here all {u['seq']} tokens), weight decay "
        f"{u['weight_decay']}; its log: {u['trainable']:,} trainable, {u['reserved_gib']} GB reserved before "
        f"training, peak {u['peak_reserved_gib']} GB (torch max_memory_reserved / 1024**3, Tesla T4)"
    )
    lines += targets(memory)
    return "\n".join(lines)


def verdict(configs: list[dict], cap: float) -> str:
    """Whether a card of ``cap`` GiB holds a run, from all its rows (one per cap it ran under)."""
    said = [fits(cap, c) for c in configs if c["status"] == "ok"]
    said += [f"no ({c['status']} under it)" for c in configs if c["status"] == "oom" and c["cap_gib"] == cap]
    for word in ("yes", "no", "unknown", "n/a"):
        if any(s.startswith(word) for s in said):
            return next(s for s in said if s.startswith(word))
    return "not measured"


def targets(memory: list[Row]) -> list[str]:
    """The issue's targets, as these rows measured them (every run at its longest form; missing ones say so)."""

    def find(shape: str, name: str, seq: int) -> list[dict]:
        wanted = (shape, name, seq)
        return [r.config for r in memory if (r.config["shape"], r.config["name"], r.config["seq"]) == wanted]

    out = []
    for shape in SHAPES:
        found = find(shape, "attn r16 adamw_8bit", 2048) + find(shape, "attn+experts r<=16 adamw_8bit", 2048)
        values = [f"{c['name']} {c['transient_gib']:.2f}" for c in found if c["status"] == "ok"]
        if values:
            out.append(f"- target: {shape} transient at 1x2048 <= 1.5 GiB: {'; '.join(values)} GiB")
    for c in find("gpt-oss-20b", "Unsloth notebook config", UNSLOTH["seq"]):
        if c["status"] == "ok":
            out.append(
                f"- target: gpt-oss-20b in Unsloth's configuration <= {UNSLOTH['reserved_gib']} GB (their "
                f"max_memory_reserved / 1024**3 on a T4): max reserved {c['max_reserved_gib']:.2f}, peak allocated "
                f"{c['max_allocated_gib']:.2f} GiB; trainable {c['trainable']:,} (theirs {UNSLOTH['trainable']:,})"
            )
    for name, cap in (("attn r16 adamw_8bit", 20.0), ("attn+experts r<=16 adamw_8bit", 24.0)):
        found = find("qwen3-30b-a3b", name, 2048)
        if found:
            ranks = sorted({c.get("rank") for c in found if c.get("rank")})
            out.append(f"- target: qwen3-30b-a3b {name} (rank {ranks}) under {cap:g} GiB: {verdict(found, cap)}")
    return out


def plot(path: Path, rows: list[Row]) -> None:
    """Peak split per run (weights / adapters + optimizer state / transient), one panel per shape, caps as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = [r for r in rows if r.metric == "memory"]
    shapes = [s for s in SHAPES if any(r.config["shape"] == s for r in memory)]
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 5), squeeze=False)
    parts = (("weights_gib", "weights at rest"), ("adapters_opt_gib", "adapters + optimizer"),
             ("transient_gib", "transient"))  # fmt: skip
    for ax, shape in zip(axes[0], shapes):
        mine = [r.config for r in memory if r.config["shape"] == shape]
        labels = [f"{c['name']}\n{c['seq']} tok, cap {c['cap_gib'] or 'none'}" for c in mine]
        bottom = [0.0] * len(mine)
        for key, label in parts:
            values = [c.get(key) or 0.0 if c["status"] == "ok" else 0.0 for c in mine]
            ax.bar(range(len(mine)), values, 0.7, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        for i, c in enumerate(mine):
            if c["status"] != "ok":
                ax.text(i, 0.5, c["status"], rotation=90, ha="center", va="bottom", fontsize=7)
        for cap in (16, 24):
            ax.axhline(cap, color="grey", linestyle="--", linewidth=1)
            ax.text(-0.4, cap, f"{cap} GiB card", fontsize=7, va="bottom", ha="left", color="grey")
        ax.set_ylim(bottom=0)
        ax.set_xticks(range(len(mine)), labels, rotation=60, ha="right", fontsize=6)
        ax.set_title(shape, fontsize=9)
        ax.set_ylabel("GiB (peak allocated, split)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[Row], out_dir: Path) -> None:
    text = "\n\n".join([table(rows), notes(rows), *__doc__.split("\n\n")[1:5]])
    write_results(NAME, rows, text, out_dir)
    plot(out_dir / f"{NAME}.png", rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--shape", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--only", default="", help="comma-separated run-name substrings")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting runs past this (seconds)")
    parser.add_argument("--list", action="store_true", help="print the runs and exit")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="merge these row files into the table")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child: one run, its result as JSON
        raw = json.loads(args.one)
        run = Run(**{**raw, "targets": tuple(raw["targets"])})
        if args.smoke:
            torch.set_num_threads(min(2, os.cpu_count() or 1))
        Path(args.out).write_text(json.dumps(run_one(run, args.smoke), default=str))
        return
    out_dir = Path(os.environ.get("BENCH_RESULTS", RESULTS))
    if args.report:
        rows: list[Row] = []
        for path in args.report:
            rows = merge(rows, read_rows(Path(path)))
        write(rows, out_dir)
        print(table(rows))
        return
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    runs = [r for shape in args.shape.split(",") for r in plan(shape.strip(), args.smoke)]
    runs = [r for r in runs if not keys or any(k in r.name for k in keys)]
    if args.list:
        for r in runs:
            print(r)
        return
    old = previous_rows(NAME, out_dir, args.smoke)

    def save(results: list[dict[str, Any]]) -> None:
        write(merge(old, [row for res in results for row in to_rows(res)]), out_dir)

    results = execute(runs, args.smoke, args.budget_s, save)
    rows = merge(old, [row for res in results for row in to_rows(res)])
    print(table(rows) + "\n\n" + notes(rows))
    print(f"wrote {out_dir / NAME}.json/.md/.png")
    bad = [r["run"]["name"] for r in results if r["status"] == "failed"]
    if bad:
        raise SystemExit(f"failed runs: {bad}")


if __name__ == "__main__":
    main()
