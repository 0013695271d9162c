"""The compiled decoding's probe: does the trainer generate with transformers' ``generate`` (not vLLM, not continuous
batching), can this model decode from a static KV cache under ``torch.compile``, does anything in the run move the
weights between calls (ZeRO-3, FSDP) or compile the layers already, and in auto mode does the measured saving pay
the compile back within the run's generation calls. The plan names the model whose ``generate`` is wrapped, TRL's
generation config (the calls to serve), the cache's shape and the compile settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compiling import unsupported_reason
from ..models import data_parallel_reason, planned_steps, unwrap_model
from ..optimization import PatchContext, Readiness
from ..report import size_text
from .measured import MEASURED
from .ops import CacheShape, Payback


AUTO_DEVICES = ("cuda",)  # where the saving was measured
# The caches TRL's `cache_implementation` may ask for that this optimization replaces with its own static cache.
OWN_CACHE = (None, "static")


@dataclass(frozen=True)
class GenerationPlan:
    model: nn.Module  # the instance TRL calls `generate` on (the PEFT model or the model itself)
    generation_config: Any  # TRL's GenerationConfig: the calls this optimization serves, recognized by identity
    cache: CacheShape
    batch: int  # sequences per generation call on this process
    max_new_tokens: int
    backend: str
    cuda_graphs: bool  # replayed as CUDA graphs (inductor on CUDA only)
    max_recompiles: int
    why: str  # why auto mode applies it ("" where applied on request)


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    cfg = ctx.config.config
    config = getattr(trainer, "generation_config", None)
    reasons = trainer_reasons(trainer, config) + run_reasons(trainer, cfg)
    model = getattr(trainer, "model", None)
    base = unwrap_model(model) if model is not None else None
    if base is not None:
        reasons += model_reasons(base)
    if reasons:  # blocked; the auto rule still says whether auto mode would have applied it here (strict)
        return Readiness.no(*reasons).with_auto_rule(auto_reason(trainer, base, config))
    plan = GenerationPlan(
        model=model,
        generation_config=config,
        cache=cache_shape(base, trainer),
        batch=generation_batch(trainer),
        max_new_tokens=int(config.max_new_tokens),
        backend=cfg.compile_generation_backend,
        cuda_graphs=cfg.compile_generation_cuda_graphs
        and cfg.compile_generation_backend == "inductor"
        and trainer.args.device.type == "cuda",
        max_recompiles=cfg.compile_generation_max_recompiles,
        why="",
    )
    slower = auto_reason(trainer, base, config)
    if slower is not None:
        return Readiness.slower(slower, describe(plan), plan)
    why = payback(trainer, base, config)[1]
    plan = dataclasses.replace(plan, why=why)
    return Readiness(detail=describe(plan), plan=plan)


def trainer_reasons(trainer: Any, config: Any) -> list[str]:
    """Whether TRL generates with transformers' plain ``generate`` from ``trainer.generation_config``."""
    if getattr(trainer, "use_vllm", False):
        return [
            "use_vllm=True: vLLM generates the completions, already compiled; compile_generation serves "
            "transformers' generate"
        ]
    if getattr(trainer, "use_transformers_continuous_batching", False) or getattr(
        getattr(trainer, "args", None), "use_transformers_paged", False
    ):
        return [
            "transformers' continuous batching generates (use_transformers_continuous_batching): it has its own "
            "paged cache; compile_generation serves the plain generate path"
        ]
    from transformers import GenerationConfig

    if not isinstance(config, GenerationConfig):
        return [
            "the trainer has no GenerationConfig at trainer.generation_config: this TRL's generation path is not "
            "recognised"
        ]
    reasons = []
    if config.cache_implementation not in OWN_CACHE:
        reasons.append(
            f"cache_implementation={config.cache_implementation!r}: compile_generation decodes from its own static "
            "cache; drop cache_implementation (or set it to 'static')"
        )
    if not isinstance(config.max_new_tokens, int) or config.max_new_tokens < 1:
        reasons.append(f"max_new_tokens={config.max_new_tokens!r}: the static cache is sized from it")
    if config.num_beams not in (None, 1):
        reasons.append(f"num_beams={config.num_beams}: beam search reorders the cache; GRPO samples (num_beams=1)")
    processing = getattr(trainer, "processing_class", None)
    if processing is not None and type(processing).__name__.endswith("Processor"):
        reasons.append(f"{type(processing).__name__}: multimodal generation (images) is not served")
    return reasons


def run_reasons(trainer: Any, cfg: Any) -> list[str]:
    """What in the run stops a compiled decode from serving every call."""
    reasons = []
    unsupported = unsupported_reason()
    if unsupported:
        reasons.append(unsupported)
    old = transformers_4_reason()
    if old:
        reasons.append(old)
    if getattr(trainer, "is_deepspeed_enabled", False):
        state = getattr(getattr(trainer, "accelerator", None), "state", None)
        if getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", None) == 3:
            reasons.append(
                "DeepSpeed ZeRO-3 gathers the weights anew for every generation call: the compiled decode would read "
                "freed memory; use ZeRO-2 or DDP, or pass compile_generation=False"
            )
    if getattr(trainer, "is_fsdp_enabled", False):
        reasons.append(
            "FSDP gathers the full weights anew for every generation call (summon_full_params): the compiled decode "
            "would read freed memory; use DDP, or pass compile_generation=False"
        )
    if cfg.compile_layers is True:
        reasons.append(
            "compile_layers=True compiles each decoder layer, and compile_generation compiles the whole decode step "
            "around them: pass one of them"
        )
    replicas = data_parallel_reason(trainer, "the wrapped generate is bound to one model instance")
    if replicas:
        reasons.append(replicas)
    return reasons


def transformers_4_reason() -> str | None:
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return None
    return (
        f"transformers {transformers.__version__}: compile_generation needs transformers >= 5 (its static cache "
        "with per-layer types and in-place reset); upgrade it or pass compile_generation=False"
    )


def model_reasons(base: nn.Module) -> list[str]:
    reasons = []
    if not getattr(type(base), "_can_compile_fullgraph", False):
        reasons.append(
            f"{type(base).__name__} does not support a static cache under torch.compile (transformers says so: "
            "_can_compile_fullgraph is False)"
        )
    quantizer = getattr(base, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        reasons.append(
            f"the model is quantized with {type(quantizer).__name__}, whose layers transformers does not compile"
        )
    if any(type(m).__name__ in ("Linear4bit", "Params4bit") for m in base.modules()):
        reasons.append("the model holds bitsandbytes 4-bit linears, which do not compile: not served yet")
    if _has_experts(base):
        reasons.append("MoE layers: the experts' routing runs a data-dependent loop that does not compile")
    return reasons


def _has_experts(model: nn.Module) -> bool:
    return any(name.endswith(".experts") for name, _ in model.named_modules())


def cache_shape(base: nn.Module, trainer: Any) -> CacheShape:
    text = base.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    dtype = _decode_dtype(base, trainer)
    return CacheShape(text.num_hidden_layers, kv, head_dim, torch.finfo(dtype).bits // 8)


def _decode_dtype(base: nn.Module, trainer: Any) -> torch.dtype:
    args = getattr(trainer, "args", None)
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)


def generation_batch(trainer: Any) -> int:
    """Sequences per generation call on one process: TRL generates a whole generation batch at once."""
    args = trainer.args
    per_step = getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps
    return int(args.per_device_train_batch_size * per_step)


def generation_calls(trainer: Any) -> int | None:
    """Generation calls in the run: one per ``steps_per_generation x num_iterations`` micro-steps."""
    steps = planned_steps(trainer)
    if steps is None:
        return None
    args = trainer.args
    per_generation = (getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps) * max(
        1, getattr(args, "num_iterations", 1)
    )
    return max(1, -(-steps * args.gradient_accumulation_steps // per_generation))


def auto_reason(trainer: Any, base: nn.Module | None, config: Any) -> str | None:
    """Where auto mode would not apply it here (the evidence), or None where it would."""
    device = trainer.args.device
    if device.type not in AUTO_DEVICES:
        measured = ", ".join(f"{family} on {m.evidence.device}, {m.evidence.date}" for family, m in MEASURED.items())
        return f"not measured on {device.type} (measured faster on CUDA only: {measured or 'none yet'})"
    pays, why = payback(trainer, base, config)
    return None if pays else why


def payback(trainer: Any, base: nn.Module | None, config: Any) -> tuple[bool, str]:
    """(whether it pays back within this run, the sentence with the arithmetic)."""
    family = getattr(getattr(base, "config", None), "model_type", None) or type(base).__name__
    measured = MEASURED.get(family)
    if measured is None:
        return False, f"not measured on {family} (measured: {', '.join(MEASURED) or 'none yet'})"
    calls = generation_calls(trainer)
    if calls is None:
        return False, (
            "the run's step count is unknown at patch time (no max_steps, no sized dataset), so the compile cost "
            f"cannot be weighed ({measured.evidence})"
        )
    tokens = int(getattr(config, "max_new_tokens", 0) or 0)
    result = Payback(calls, tokens, measured.saving_ms, measured.compile_s)
    verdict = "pays back within this run" if result.pays else "does not pay back within this run"
    return result.pays, f"{verdict}: {result.sentence()} ({measured.evidence})"


def describe(plan: GenerationPlan) -> str:
    graphs = " with CUDA graphs" if plan.cuda_graphs else ""
    per_call = plan.cache.bytes(plan.batch, plan.max_new_tokens)
    text = (
        f"torch.compile ({plan.backend}{graphs}) of the decode step over a static KV cache; cache "
        f"{size_text(plan.cache.bytes_per_token * plan.batch)} a position for {plan.batch} sequences "
        f"({size_text(per_call)} for the {plan.max_new_tokens} new tokens, plus the prompt's), lengths in steps of "
        f"64, at most {plan.max_recompiles} recompiles"
    )
    return text + (f"; {plan.why}" if plan.why else "")
