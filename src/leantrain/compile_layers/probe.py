"""The compiled layers' probe: is there one decoder-layer class to compile, does anything in the run stop Dynamo
from serving it (OSFT's factored modules, 4-bit MoE experts moe4bit does not serve, modules with a class per layer,
ZeRO-3, several processes), and in auto mode does the measured saving pay the compile back within the run's steps.
The plan names the layers and the stock forward ``apply`` compiles."""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..compiling import unsupported_reason
from ..models import data_parallel_reason, decoder_parts, planned_steps, tokens_per_micro_batch, unwrap_model
from ..optimization import PatchContext, Readiness
from .measured import BACKGROUND_MOE_4BIT, KNOWN_FAILURES, MEASURED, MOE_4BIT, QUANTIZED_4BIT, Measured
from .ops import Payback, mlp_min_rows


MOE4BIT = "moe4bit"  # the optimization whose grouped 4-bit experts the compiled layers trace (applied before them)
AUTO_KINDS = ("sft", "trainer")  # where the saving was measured (training steps of SFT / plain Trainer)
FALLBACK_COMPILE_S = 15.3  # a family without its own cold-start measurement: Llama-3.2-1B's (measured.py)


@dataclass(frozen=True)
class CompilePlan:
    family: str
    layers: tuple[tuple[str, nn.Module], ...]  # qualified name, decoder layer instance
    stock: Callable[..., Any]  # the layer class's forward (a plain function), what the eager path runs
    backend: str
    dynamic: str  # "auto" or "always" (config.COMPILE_DYNAMIC)
    recompute: str  # "default" or "elementwise" (config.COMPILE_RECOMPUTE): what the compiled backward recomputes
    mlp_chunks: int  # row chunks of a gated LoRA MLP's backward (ops.gated_lora_mlp); 0: autograd's per projection
    mlp_min_rows: int  # the micro-batch rows from which the chunks apply (ops.mlp_min_rows); 0: every micro-batch
    max_recompiles: int
    background: bool  # inductor's lowering in a child process while the traced layers run (compiling.background)
    background_why: str  # auto mode's evidence where it chose the child process; "" where asked or off
    cache: str  # where inductor's FX-graph and AOTAutograd caches live, and whether they are on
    why: str


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    cfg = ctx.config.config
    model = unwrap_model(trainer.model)
    family = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    try:
        parts = decoder_parts(model)
    except ValueError as error:
        return Readiness.not_applicable(f"{error}: compile_layers compiles the decoder layers of a causal LM")
    layers = list(parts.layers)
    if not layers:
        return Readiness.not_applicable(f"{type(model).__name__} has no decoder layers")
    # the auto rule first: strict mode raises on a blocker only where auto mode would compile the layers
    served = MOE4BIT in ctx.applying  # its grouped 4-bit experts, traced inside the compiled layers
    slower = slower_reason(trainer, ctx.trainer_kind, family, layers[0], served)
    rule = slower if isinstance(slower, str) else None
    reasons = run_reasons(trainer, model, family, layers, cfg, served)
    if reasons:
        return Readiness.no(*reasons).with_auto_rule(rule)
    prefix = getattr(model, "base_model_prefix", "model")
    trunk = next((n for n, m in model.named_modules() if m is parts.layers), f"{prefix}.layers")
    background = background_choice(cfg, trainer.args.device, layers[0], served)
    plan = CompilePlan(
        family=family,
        layers=tuple((f"{trunk}.{i}", layer) for i, layer in enumerate(layers)),
        stock=type(layers[0]).forward,
        backend=cfg.compile_layers_backend,
        dynamic=cfg.compile_layers_dynamic,
        recompute=cfg.compile_layers_recompute,
        mlp_chunks=cfg.compile_layers_mlp_chunks,
        mlp_min_rows=mlp_min_rows(cfg.compile_layers_mlp_chunks, tokens_per_micro_batch(trainer)),
        max_recompiles=cfg.compile_layers_max_recompiles,
        background=background is not None,
        background_why=background or "",
        cache=cache_description(cfg.compile_layers_backend),
        why="",
    )
    if isinstance(slower, str):
        return Readiness.slower(slower, describe(plan), plan)
    plan = dataclasses.replace(plan, why=slower[1])
    return Readiness(detail=describe(plan), plan=plan)


def background_choice(cfg: Any, device: torch.device, layer: nn.Module, moe4bit_serves: bool) -> str | None:
    """Whether the layers compile in a child process (``compile_layers_background``): None for no, "" where asked,
    else auto mode's evidence. Auto: on CUDA, inductor with static shapes first, for MoE layers whose 4-bit experts
    moe4bit serves (the longest compile: measured to move the first step from 18-23 s to 6-8 s, the run as long)."""
    if cfg.compile_layers_background is not None:
        return "" if cfg.compile_layers_background else None
    auto = (
        device.type == "cuda"
        and cfg.compile_layers_backend == "inductor"
        and cfg.compile_layers_dynamic == "auto"
        and moe4bit_serves
        and _has_4bit_experts(layer)
    )
    return f"auto: {BACKGROUND_MOE_4BIT}" if auto else None


def slower_reason(
    trainer: Any, kind: str, family: str, layer: nn.Module, moe4bit_serves: bool = False
) -> str | tuple[None, str]:
    """Where compiling is not measured to pay off here (auto mode skips, ``compile_layers=True`` compiles): the
    evidence, or (None, why it pays). ``moe4bit_serves``: moe4bit applies in this run (its grouped path serves every
    4-bit experts module it finds)."""
    if kind not in AUTO_KINDS:
        return (
            f"measured on SFT training steps only, not on {kind} trainers (generation would compile the cached "
            "decode path too)"
        )
    device = trainer.args.device
    if device.type != "cuda":
        return f"not measured on {device.type} (measured faster on CUDA only: {_measured_families()})"
    if moe4bit_serves and _has_4bit_experts(layer):  # compiled moe4bit experts: their own row
        return payback_reason(trainer, family, MOE_4BIT)
    if _quantized(layer) and family in MEASURED:  # QLoRA: its own row (faster and a lower peak, measured on Llama)
        return payback_reason(trainer, family, QUANTIZED_4BIT)
    return payback_reason(trainer, family)


def _measured_families() -> str:
    """``llama, qwen2, gemma2 on H200, 2026-11-27``: which families were measured where and when."""
    where = sorted({f"{m.evidence.device}, {m.evidence.date}" for m in MEASURED.values()})
    return f"{', '.join(MEASURED)} on {'; '.join(where)}"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _transformers_4_reason() -> str | None:
    """On transformers 4.x every decoder layer compiled its own graph (3 compiles for a 3-layer tiny Llama, where
    transformers 5 shares one), so a real model's layers would pass the recompile limit and run eagerly."""
    version = _transformers_version()
    if int(version.split(".")[0]) >= 5:
        return None
    return (
        f"on transformers {version} each decoder layer compiles its own graph (no code shared between layers), so "
        "a model's layers would pass the recompile limit: compile_layers needs transformers >= 5; upgrade it or pass "
        "compile_layers=False"
    )


def run_reasons(
    trainer: Any, model: nn.Module, family: str, layers: list[nn.Module], cfg: Any, moe4bit_serves: bool = False
) -> list[str]:
    """What stops the compiled layers from serving this run (each a sentence naming the next step);
    ``moe4bit_serves``: moe4bit applies in this run (before compile_layers: its grouped path is what compiles)."""
    reasons = []
    unsupported = unsupported_reason()
    if unsupported:
        reasons.append(unsupported)
    old = _transformers_4_reason()
    if old:
        reasons.append(old)
    classes = {type(layer) for layer in layers}
    if len(classes) > 1:
        names = ", ".join(sorted(c.__name__ for c in classes))
        reasons.append(f"the decoder layers are of {len(classes)} classes ({names}); one compiled code needs one")
    first = layers[0]
    patched = [i for i, layer in enumerate(layers) if "forward" in vars(layer)]
    if patched:
        reasons.append(
            f"decoder layer {patched[0]} already runs {_qualname(first.forward)} bound on the instance: another "
            "library patched the layers; compile_layers compiles the class's own forward"
        )
    compiled = [i for i, layer in enumerate(layers) if getattr(layer, "_compiled_call_impl", None) is not None]
    if compiled:
        reasons.append(
            f"decoder layer {compiled[0]} is already compiled (layer.compile()): drop that call, compile_layers "
            "compiles every layer once with a recompile limit and a fallback"
        )
    if not isinstance(getattr(type(first), "forward", None), types.FunctionType):
        reasons.append(f"{type(first).__name__}.forward is not a plain function here; nothing to compile")
    if cfg.osft:
        reasons.append(
            "osft is on: OSFT's factored modules run closures and a per-step projection that Dynamo would have to "
            "retrace; pass compile_layers=False (or osft=False)"
        )
    four_bit = _has_4bit_experts(first)
    if cfg.moe4bit is not False and four_bit and not moe4bit_serves:
        reasons.append(
            "MoE layers with 4-bit experts that moe4bit does not serve in this run (its report says why): their "
            "stock per-expert loop breaks the compiled graph at every expert; pass moe4bit=True (its grouped path "
            "compiles), moe4bit=False to compile the stock experts (not measured), or compile_layers=False"
        )
    wrapped = _parameter_lora(first, skip_experts=four_bit and moe4bit_serves)
    if wrapped:
        reasons.append(
            f"{wrapped} holds PEFT's LoRA on a parameter (target_parameters: ParamWrapper), which registers and "
            "removes a torch parametrization on every forward: the compiled graph breaks there and recompiles "
            "each call until the limit; for MoE experts, put them in 4-bit (leantrain.quantize_experts_4bit) for "
            "moe4bit's grouped path, which serves that LoRA and compiles, else pass compile_layers=False"
        )
    own = _own_classes(layers, skip_experts=four_bit and moe4bit_serves)
    if own:
        reasons.append(own)
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
        stage = getattr(getattr(plugin, "deepspeed_plugin", None), "zero_stage", None)
        if stage == 3:
            reasons.append(
                "DeepSpeed ZeRO-3 gathers each layer's parameters in module hooks that Dynamo cannot trace: pass "
                "compile_layers=False, or use ZeRO-2 / FSDP2"
            )
    world = getattr(getattr(trainer, "args", None), "world_size", 1)
    if isinstance(world, int) and world > 1:
        reasons.append(
            f"{world} processes (DDP / FSDP): compiled layers are measured on one GPU only; under several processes "
            "they are declined until measured (pass compile_layers=False to silence this)"
        )
    replicas = data_parallel_reason(trainer, "the compiled forward is bound to each layer instance")
    if replicas:
        reasons.append(replicas)
    known = next((e for (f, v), e in KNOWN_FAILURES.items() if f == family and torch.__version__.startswith(v)), None)
    if known:
        reasons.append(f"{family}'s decoder layer does not compile on torch {torch.__version__}: {known}")
    return reasons


def payback_reason(trainer: Any, family: str, measured: Measured | None = None) -> str | tuple[None, str]:
    """Auto mode: a skip reason with the arithmetic, or (None, why it applies); ``measured``: the row to weigh (by
    default the family's)."""
    measured = measured or MEASURED.get(family)
    if measured is None:
        return f"not measured on {family} (measured: {', '.join(MEASURED)})"
    steps = planned_steps(trainer)
    if steps is None:
        return (
            "the run's step count is unknown at patch time (no max_steps, no sized dataset), so the compile cost "
            f"cannot be weighed ({measured.evidence})"
        )
    compile_s = measured.compile_s or FALLBACK_COMPILE_S
    payback = Payback(steps, measured.saving_ms, compile_s)
    if not payback.pays:
        return f"does not pay back within this run: {payback.sentence()} ({measured.evidence})"
    return None, f"pays back within this run: {payback.sentence()} ({measured.evidence})"


def cache_description(backend: str) -> str:
    """Where inductor keeps its FX-graph and AOTAutograd caches (read, never set: torch's own per-user directory,
    moved with TORCHINDUCTOR_CACHE_DIR), and whether they are on."""
    if backend != "inductor":
        return f"no persistent cache for the {backend} backend"
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    on = [
        n
        for n, v in (("FX graph", inductor_config.fx_graph_cache), ("AOTAutograd", _autograd_cache(functorch_config)))
        if v
    ]
    if inductor_config.force_disable_caches or not on:
        return "compile caches off in this process (torch's settings); a second launch compiles again"
    return f"{' and '.join(on)} caches in {where} (a second launch reuses them; delete the directory to clear)"


def _autograd_cache(functorch_config: Any) -> bool:
    return bool(getattr(functorch_config, "enable_autograd_cache", False))


def describe(plan: CompilePlan) -> str:
    dynamic = "dynamic sequence length from the first new length" if plan.dynamic == "auto" else "dynamic shapes"
    lean = (
        "; elementwise ops recomputed in the backward (less saved per layer)"
        if plan.recompute == "elementwise"
        else ""
    )
    background = (
        "; compiled in a child process while the first steps run the layers uncompiled (the compiled code takes "
        "over at a step boundary" + (f"; {plan.background_why})" if plan.background_why else ")")
        if plan.background
        else ""
    )
    return (
        f"torch.compile ({plan.backend}, {dynamic}) of {type(plan.layers[0][1]).__name__}.forward, one compiled code "
        f"for {len(plan.layers)} layers, at most {plan.max_recompiles} recompiles{lean}{background}; {plan.cache}"
        + (f"; {plan.why}" if plan.why else "")
    )


def _quantized(layer: nn.Module) -> str | None:
    """The first 4-bit linear class inside ``layer`` (QLoRA's bitsandbytes ``Linear4bit``), by name; None if none."""
    return next((type(m).__name__ for m in layer.modules() if type(m).__name__ in ("Linear4bit", "Params4bit")), None)


def _has_4bit_experts(layer: nn.Module) -> bool:
    """Whether ``layer`` holds MoE experts in bitsandbytes 4-bit (layers or parametrizations of its classes, read
    without importing it): the only experts moe4bit serves. Plain experts compile as the stock code."""
    return any(_holds_4bit(experts) for name, experts in layer.named_modules() if name.endswith("experts"))


def _holds_4bit(module: nn.Module) -> bool:
    """Whether ``module`` holds bitsandbytes 4-bit layers or parametrizations (by class, bitsandbytes not imported)."""
    return any(
        cls.__module__.partition(".")[0] == "bitsandbytes"
        for m in module.modules()
        for cls in type(m).__mro__  # leantrain.quantize_experts_4bit's parametrization subclasses bitsandbytes'
    )


PARAMETER_LORA = "ParamWrapper"  # PEFT's LoRA on an nn.Parameter (target_parameters), by class name


def _parameter_lora(layer: nn.Module, skip_experts: bool) -> str | None:
    """The name of the first module of ``layer`` that is a PEFT parameter-LoRA wrapper, or None. ``skip_experts``:
    moe4bit serves the 4-bit experts (its grouped path reads their adapters; their wrapper's forward never runs)."""
    for name, module in layer.named_modules():
        if type(module).__name__ == PARAMETER_LORA and not (skip_experts and _holds_4bit(module)):
            return name
    return None


def _own_classes(layers: list[nn.Module], skip_experts: bool) -> str | None:
    """A reason when a module of the layers has a parametrized class of its own in each layer (torch's
    ``register_parametrization`` makes one class per module, e.g. for bitsandbytes' 4-bit stacks): compiled code
    guards on each module's type, so every layer would compile its own graph and pass the recompile limit.
    ``skip_experts``: moe4bit serves the 4-bit experts, and gives them one class while patched."""
    first = dict(layers[0].named_modules())
    for index, layer in enumerate(layers[1:], start=1):
        for name, module in layer.named_modules():
            other = first.get(name)
            own, theirs = type(module), type(other)
            if other is None or own is theirs or own.__bases__ != theirs.__bases__:
                continue
            if skip_experts and _holds_4bit(module):  # moe4bit gives its experts one class while patched
                continue
            if parametrize.is_parametrized(module) and parametrize.is_parametrized(other):
                return (
                    f"layer {index}'s {name} has a parametrized class of its own ({own.__name__}: torch's "
                    "parametrization makes one per module), so each decoder layer would compile its own graph and "
                    "pass the recompile limit: for 4-bit MoE experts pass moe4bit=True (it gives them one class "
                    "while patched), else compile_layers=False"
                )
    return None


def _qualname(obj: Any) -> str:
    func = getattr(obj, "__func__", obj)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(obj).__name__)}"
