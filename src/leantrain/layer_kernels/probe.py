"""The layer kernels' probe: is this a served family on CUDA with Liger-Kernel installed, did anything patch its
modules already, and which module instances get which kernel (the plan ``apply`` executes)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from ..models import data_parallel_reason, decoder_parts, unwrap_model
from ..optimization import PatchContext, Readiness, install_command
from . import ops
from .families import FAMILIES, MEASURED, Family


ROPE = "apply_rotary_pos_emb"  # the modeling module's function that the attention forward calls by name
AUTO_KINDS = ("sft", "trainer")  # where the families' verdicts were measured (SFT / plain Trainer training steps)
KERNEL_DEVICES = ("cuda",)  # Liger's Triton kernels (the tests' torch stand-ins add "cpu")


@dataclass(frozen=True)
class LayerKernelsPlan:
    """The module instances to serve, by qualified name, and the facts the report gives."""

    family: str
    spec: Family
    modeling: ModuleType  # the family's transformers modeling module (the stock RoPE function lives there)
    norms: tuple[tuple[str, nn.Module], ...]
    mlps: tuple[tuple[str, nn.Module], ...]
    attentions: tuple[tuple[str, nn.Module], ...]  # their forwards get Liger's RoPE; empty when RoPE is left out
    left_out: tuple[str, ...]  # kernels not served here, each with its reason
    why: str  # why auto mode applies it: the measured verdict ("" where the entry point applies it on request)


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    model = unwrap_model(trainer.model)
    name = getattr(getattr(model, "config", None), "model_type", None)
    spec = FAMILIES.get(name)
    if spec is None:
        return Readiness.not_applicable(f"no layer kernels for model type {name!r} (served: {', '.join(FAMILIES)})")
    verdict = MEASURED.get(name)
    evidence = str(verdict) if verdict else "no measurement yet"
    slower = None  # auto mode applies the kernels only where they measured faster, on the trainers measured
    if ctx.trainer_kind not in AUTO_KINDS:
        slower = f"measured on SFT training steps only, not on {ctx.trainer_kind} trainers"
    elif verdict is None or not verdict.faster:
        slower = f"not measured faster on {name} ({evidence})"
    # the entry point weighs the auto rule with any blocker (strict mode raises only where the kernels were due)
    return _ready(
        trainer, model, name, spec, "" if slower else f"measured faster on {name} ({evidence})"
    ).with_auto_rule(slower)


def _ready(trainer: Any, model: nn.Module, name: str, spec: Family, why: str) -> Readiness:
    device = trainer.args.device
    if device.type not in KERNEL_DEVICES:
        # strict mode does not raise on it in auto mode; layer_kernels=True does
        return Readiness.not_applicable(
            f"Liger-Kernel's layer kernels are Triton kernels for CUDA; this trainer runs on {device.type}"
        )
    reasons = conflicts(trainer, model, name, spec)
    if reasons:
        return Readiness.no(*reasons)
    missing = liger_reason()
    if missing:
        return Readiness.no(missing)
    return plan_targets(model, name, spec, why)


def liger_reason() -> str | None:
    """None when Liger-Kernel's ops import; else what to install. Imported only here and at apply (seconds)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return f"liger_kernel is not installed: {install_command('kernels')}"
    try:
        ops.kernels()
    except Exception as error:  # ImportError, or a broken install raising something else
        return f"liger_kernel is installed but its kernels do not import ({type(error).__name__}: {error})"
    return None


def conflicts(trainer: Any, model: nn.Module, name: str, spec: Family) -> list[str]:
    """Someone else's kernels on these modules, now or when ``train()`` starts; DataParallel replicas."""
    reasons = []
    if getattr(trainer.args, "use_liger_kernel", False):
        reasons.append(
            "use_liger_kernel=True: the trainer applies Liger-Kernel's own patch when train() starts, which also "
            f"replaces classes and functions of transformers' {name} modeling module for the whole process; drop "
            "use_liger_kernel to get the same kernels on this model only (layer_kernels), or pass layer_kernels=False"
        )
    modeling = sys.modules.get(type(model).__module__)
    replaced = [n for n in (spec.norm_class, spec.mlp_class) if not _own(modeling, getattr(modeling, n, None))]
    liger_rope = getattr(getattr(modeling, ROPE, None), "__module__", "").startswith("liger_kernel")
    if replaced or liger_rope:
        what = ", ".join(f"{n} is {_qualname(getattr(modeling, n, None))}" for n in replaced or [ROPE])
        reasons.append(
            f"transformers' {name} modeling module was patched for the whole process ({what}): Liger-Kernel's "
            f"apply_liger_kernel_to_{name}() or use_liger_kernel ran in this process, so its kernels already serve "
            "models built after it"
        )
    replicas = data_parallel_reason(
        trainer, "the kernels are bound to each module instance, and every replica would run the original's"
    )
    return reasons + ([replicas] if replicas else [])


def plan_targets(model: nn.Module, name: str, spec: Family, why: str) -> Readiness:
    try:
        parts = decoder_parts(model)
    except ValueError as error:
        return Readiness.no(f"{error}: the layer kernels need a decoder-only causal LM")
    modeling = sys.modules[type(model).__module__]
    prefix = getattr(model, "base_model_prefix", "model")
    found: dict[str, list[tuple[str, nn.Module]]] = {spec.norm_class: [], spec.mlp_class: [], spec.attention_class: []}
    for sub, module in parts.trunk.named_modules():
        cls = type(module)
        if cls.__name__ in found and cls.__module__ == modeling.__name__:
            found[cls.__name__].append((f"{prefix}.{sub}", module))
    norms, mlps, attentions = (tuple(found[c]) for c in (spec.norm_class, spec.mlp_class, spec.attention_class))
    for i, layer in enumerate(parts.layers):
        for attr, cls in (("mlp", spec.mlp_class), ("self_attn", spec.attention_class)):
            module = getattr(layer, attr, None)
            if type(module).__name__ != cls:
                return Readiness.no(
                    f"{prefix}.layers.{i}.{attr} is {_qualname(type(module))}, not transformers' {cls}: another "
                    "library replaced the modules"
                )
    patched = [(n, m) for n, m in norms + mlps + attentions if "forward" in vars(m) or not _own(modeling, m.forward)]
    if patched:
        where, module = patched[0]
        return Readiness.no(
            f"{where} already runs {_qualname(module.forward)} instead of transformers' forward: another library "
            f"patched the modules ({len(patched)} of them), e.g. Liger-Kernel's "
            f"apply_liger_kernel_to_{name}(model=...) or Hub kernels' kernelize"
        )
    left_out = []
    activation = getattr(model.config, spec.act_attr, None)
    if activation not in spec.activations:
        left_out.append(
            f"{spec.gate} MLP: the activation is {activation!r}; the kernel computes {spec.activations[0]}"
        )
        mlps = ()
    widths = {m.weight.shape[-1] for _, m in norms}
    if max(widths, default=0) > ops.MAX_FUSED_COLUMNS:
        left_out.append(f"RMSNorm: rows of {max(widths)} exceed Liger's fused row limit ({ops.MAX_FUSED_COLUMNS})")
        norms = ()
    width = getattr(model.config, "intermediate_size", 0) or 0
    if spec.gate == "geglu" and mlps and width > ops.MAX_FUSED_COLUMNS:
        left_out.append(f"geglu MLP: intermediate size {width} exceeds Liger's fused row limit")
        mlps = ()
    rope = rope_reason(modeling, spec)
    if rope:
        left_out.append(f"RoPE: {rope}")
        attentions = ()
    if not (norms or mlps or attentions):
        return Readiness.no("no kernel serves this model: " + "; ".join(left_out))
    plan = LayerKernelsPlan(name, spec, modeling, norms, mlps, attentions, tuple(left_out), why)
    return Readiness(detail=describe(plan), plan=plan)


def rope_reason(modeling: ModuleType, spec: Family) -> str | None:
    """RoPE is served per instance by a copy of the attention's own forward that looks ``apply_rotary_pos_emb`` up in
    a copy of the modeling module's globals, so the module itself is never changed: that needs the stock forward,
    undecorated, calling the stock function by that name."""
    forward = getattr(getattr(modeling, spec.attention_class, None), "forward", None)
    stock = getattr(modeling, ROPE, None)
    if not _own(modeling, stock):
        return f"{modeling.__name__}.{ROPE} is {_qualname(stock)}, not transformers' own"
    if hasattr(forward, "__wrapped__"):  # transformers 4.x: @deprecate_kwarg
        return f"{spec.attention_class}.forward is wrapped by a decorator in this transformers version"
    if not _own(modeling, forward) or forward.__globals__ is not vars(modeling):
        return f"{spec.attention_class}.forward is not transformers' own: another library replaced it"
    if ROPE not in forward.__code__.co_names:
        return f"{spec.attention_class}.forward does not call {ROPE} by name in this transformers version"
    return None


def describe(plan: LayerKernelsPlan) -> str:
    spec = plan.spec
    served = []
    if plan.norms:
        scale = "(1 + w)" if spec.offset == 1 else "w"
        served.append(f"RMSNorm ({spec.casting} casting, scale {scale}) x{len(plan.norms)}")
    if plan.mlps:
        served.append(f"{spec.gate} MLP x{len(plan.mlps)}")
    if plan.attentions:
        served.append(f"RoPE in {len(plan.attentions)} attention forwards")
    text = "Liger-Kernel " + ", ".join(served) + ", bound on this model's module instances"
    if plan.left_out:
        text += "; left out: " + "; ".join(plan.left_out)
    return f"{text}; {plan.why}" if plan.why else text


def _own(modeling: ModuleType | None, obj: Any) -> bool:
    """Whether ``obj`` (a class, function or bound method) is defined in the modeling module itself."""
    func = getattr(obj, "__func__", obj)
    return modeling is not None and obj is not None and getattr(func, "__module__", None) == modeling.__name__


def _qualname(obj: Any) -> str:
    func = getattr(obj, "__func__", obj)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(obj).__name__)}"
