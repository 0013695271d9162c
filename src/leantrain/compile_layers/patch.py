"""The compiled forward ``apply`` binds on every decoder layer instance (never on the class).

One ``torch.compile`` of a private copy of the layer class's forward (``compiling.private_copy``) serves every layer:
the layer is an argument, so Dynamo compiles once and reuses the entry for each instance. Transformers' checkpointing
(``GradientCheckpointingLayer.__call__``) wraps ``nn.Module.__call__``, which calls the instance's forward: the
checkpoint wraps the compiled region, in both modes. Every call runs through the run-time fallback: a compile error
warns once and the stock forward serves from then on (a checkpoint's recompute keeps the path its forward took).
The compile backend is wrapped to count compiles: past the recompile limit the eager layers take over (warned once,
the report marked failed), before torch's own limit would make Dynamo run eagerly without a word."""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from ..compiling import CountingBackend, private_copy, warm_compile_workers
from ..compiling.background import BackgroundBackend
from ..fallback import EAGER_CHECK_ATTR, TRACEABLE_ATTR, RuntimeFallback, recomputing
from ..undo import Undo
from .ops import (
    checkpointing_inner,
    gated_lora_mlp,
    is_gated_lora_mlp,
    lora4bit_scaled_on_rank,
    lora_scaled_on_rank,
    recomputing_elementwise,
    scaling_folds,
    with_inner,
)
from .probe import CompilePlan


STATS_ATTR = "leantrain_compile_layers"  # on the trainer: the live CompileStats (compiles, recompiles)


class RecompileLimit(RuntimeError):
    """Strict mode: the layers recompiled more often than ``compile_layers_max_recompiles`` allows."""


class BackgroundCompileError(RuntimeError):
    """Strict mode: the child process compiling the layers failed."""


class CompileStats(CountingBackend):
    """Counts the graphs compiled for the layer code (its backend is the counting wrapper): the first compile(s)
    plus recompiles on new shapes or guards; past the limit the eager layers serve the rest of training."""

    what = "compile_layers: the decoder layers"

    def __init__(self, plan: CompilePlan, fallback: RuntimeFallback) -> None:
        backend = torch._dynamo.lookup_backend(plan.backend)
        # the child compiles what this process would: the recompute switch is set around the hand-over too
        self.background = None
        if plan.background:
            self.background = BackgroundBackend(backend, self.retrace, self.background_failed)
            backend = self.background.backend
        if plan.recompute == "elementwise":
            backend = recomputing_elementwise(backend)
        super().__init__(backend, plan.max_recompiles)
        self.plan, self.fallback = plan, fallback
        self.code: types.CodeType | None = None  # the compiled code object (install sets it)
        if self.background is not None:
            self.seen = self.background.seen

    def retrace(self) -> None:
        """A child finished: Dynamo's entries for the layer code go, so the next call traces again and compiles
        the finished graphs here from the warm cache (``seen``: not counted as recompiles)."""
        if self.code is not None:
            torch._dynamo.eval_frame.remove_from_cache(self.code)

    def background_failed(self, reason: str) -> None:
        """A child's compile failed (its graph ran uncompiled so far): the eager layers serve from here on."""
        if self.fallback.strict:
            raise BackgroundCompileError(reason)
        self.fallback.fail(reason)

    def past_limit(self, recompiles: int) -> None:
        reason = (
            f"the decoder layers recompiled {recompiles} times (compile_layers_max_recompiles="
            f"{self.plan.max_recompiles}): each new shape or guard compiles again, so the eager layers serve the "
            "rest of training; pad batches to fewer lengths (pad_to_multiple_of), set "
            "compile_layers_dynamic='always', or raise the limit"
        )
        if self.fallback.strict:
            raise RecompileLimit(reason)
        self.fallback.fail(reason)


def install(
    plan: CompilePlan, undo: Undo, fallback: RuntimeFallback, trainer: Any
) -> tuple[tuple[str, ...], int, int, int]:
    """Bind the compiled forward on every planned layer (each recorded on ``undo``); the qualified names, how many
    kernel forwards bound inside the layers it took over, on how many LoRA linears the scaling moved to the rank-r
    side (``ops.lora_scaled_on_rank``), and how many gated LoRA MLPs run as one function (``ops.gated_lora_mlp``).

    The compiled region is the layer's own forward; where transformers checkpoints inside ``forward``
    (``forward_with_checkpointing``), each instance gets a copy of that wrapper calling the compiled forward, so the
    checkpoint wraps the compiled layer (torchtitan's order: activation checkpointing, then compile)."""
    stats = CompileStats(plan, fallback)
    inner = checkpointing_inner(plan.stock) or plan.stock
    dynamic = None if plan.dynamic == "auto" else True  # None: static first, dynamic dims from the first change
    code = private_copy(inner)
    stats.code = code.__code__
    compiled = torch.compile(code, backend=stats.backend, dynamic=dynamic)
    fast: Callable[..., Any] = compiled
    if stats.background is None:  # the child starts its own
        warm_compile_workers(plan.backend, plan.layers[0][1])
    else:
        undo.add_callback(trainer, PromoteAtStepBegin(stats.background))
        undo.push(stats.background.close)
        fast = while_compiling(stats.background, compiled, inner)
    checks = {id(layer): eager_checks(layer) for _, layer in plan.layers}

    capture = TraceableCapture()

    def guarded(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if fallback.failed is None and not recomputing():  # a checkpoint's recompute: its forward checked
            for check in checks.get(id(self), ()):
                check()
        with capture.around(self):
            return fallback.call_at(self, fast, inner, self, *args, **kwargs)

    forward = guarded if inner is plan.stock else with_inner(plan.stock, guarded)
    forward.__leantrain_original__ = plan.stock  # type: ignore[attr-defined]
    for _, layer in plan.layers:
        undo.set_attr(layer, "forward", types.MethodType(forward, layer))
    taken = kernel_forwards(plan)
    for module in taken:  # compiled instead: inductor fuses what these kernels did
        undo.set_attr(module, "forward", types.MethodType(type(module).forward, module))
    folded = lora_linears(plan)
    for module, forward in folded:
        undo.set_attr(module, "forward", types.MethodType(forward, module))
    mlps = gated_mlps(plan, {id(module) for module, _ in folded}) if plan.mlp_chunks else []
    for module in mlps:
        undo.set_attr(module, "forward", types.MethodType(chunked_mlp(plan.mlp_chunks, plan.mlp_min_rows), module))
    undo.set_attr(trainer, STATS_ATTR, stats)
    return tuple(name for name, _ in plan.layers), len(taken), len(folded), len(mlps)


def while_compiling(background: BackgroundBackend, compiled: Callable[..., Any], eager: Callable[..., Any]):
    """The compiled forward, except while a child compiles after the step that traced: then the eager forward (not
    the traced graph, whose autograd.Function calls hold their saved tensors until the cycle collector runs).
    ``background.eager`` changes only at a step boundary, so a checkpoint's recompute takes its forward's path."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return (eager if background.eager else compiled)(*args, **kwargs)

    return forward


class PromoteAtStepBegin(TrainerCallback):
    """The background compile's code takes over at the start of an optimizer step: every forward of the step before
    has had its backward (and its checkpoints' recomputes), so no recompute runs another path than its forward."""

    def __init__(self, background: BackgroundBackend) -> None:
        self.background = background

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.background.pending:
            self.background.promote()


class TraceableCapture:
    """transformers' captured outputs (an MoE model's router logits, which TRL's load-balancing loss reads) made
    traceable inside the compiled layers.

    transformers records them with a forward hook on each layer's router that reads the run's collector from a
    ``ContextVar``; Dynamo cannot trace ``ContextVar.get`` (a graph break in every layer, past the recompile limit on
    the first step). Its ``CompileableContextVar`` has a plain-attribute mode for traced code (``compiling``,
    ``global_var``), which it enters only when the whole model is compiled. Around each compiled layer call this turns
    that mode on with a collector of fresh empty lists (the same keys, so the same guards at every layer and step),
    and appends what the layer captured to the run's own lists afterwards, in the layer order. A checkpoint's
    recompute gets a collector of the same keys whose captures are dropped, as transformers' collector is not active
    in the backward. The eager layers (after a fallback) go through the same collector, with the same result. A
    collector asking for hidden states is left alone (the hook reads its list's length)."""

    def __init__(self) -> None:
        self.var = _collector_var()
        self._keys: weakref.WeakKeyDictionary[Any, dict[str, Any] | None] = weakref.WeakKeyDictionary()

    @contextlib.contextmanager
    def around(self, site: Any) -> Iterator[None]:
        var = self.var
        if var is None or var.compiling:  # no transformers collector, or a whole-model compile set it
            yield
            return
        real = None if recomputing() else var.get()
        if real is not None and "hidden_states" in real:
            yield
            return
        if recomputing():
            layout = self._keys.get(site)
        else:
            layout = None if real is None else {k: (LIST if isinstance(v, list) else v) for k, v in real.items()}
            self._keys[site] = layout
        fresh = None if layout is None else {k: ([] if v is LIST else v) for k, v in layout.items()}
        var.global_var, var.compiling = fresh, True
        try:
            yield
        finally:
            var.global_var, var.compiling = None, False
        if real is not None and fresh is not None:
            for key, value in fresh.items():
                if layout[key] is LIST:
                    real[key].extend(value)


LIST = object()  # in a collector's layout: a list the hooks append to


def _collector_var() -> Any | None:
    """transformers' ``CompileableContextVar`` of captured outputs, where this transformers has one."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    var = getattr(output_capturing, "_active_collector", None)
    return var if all(hasattr(var, name) for name in ("compiling", "global_var", "get")) else None


# PEFT's LoRA linears served with the scaling on the rank-r side: (module, class name) -> the forward
RANK_SIDE = {
    ("peft.tuners.lora.layer", "Linear"): lora_scaled_on_rank,
    ("peft.tuners.lora.bnb", "Linear4bit"): lora4bit_scaled_on_rank,
}


def lora_linears(plan: CompilePlan) -> list[tuple[torch.nn.Module, Callable[..., Any]]]:
    """PEFT's plain and 4-bit LoRA linears inside the layers (not its other classes, whose forwards differ) with one
    adapter, no DoRA or LoRA bias and a power-of-two scaling, each with the rank-side forward that serves it with
    the same bits."""
    found = []
    for _, layer in plan.layers:
        for module in layer.modules():
            forward = RANK_SIDE.get((type(module).__module__, type(module).__name__))
            if forward is None or "forward" in vars(module):
                continue
            adapters = list(getattr(module, "lora_A", {}))
            if len(adapters) == 1 and hasattr(module, "_cast_input_dtype") and scaling_folds(module, adapters[0]):
                found.append((module, forward))
    return found


def chunked_mlp(chunks: int, min_rows: int) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """``ops.gated_lora_mlp`` with its backward in ``chunks`` row chunks from ``min_rows`` rows, as a forward to
    bind."""

    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return gated_lora_mlp(self, x, chunks, min_rows)

    return forward


def gated_mlps(plan: CompilePlan, folded: set[int]) -> list[torch.nn.Module]:
    """The stock SiLU-gated MLPs inside the layers whose three projections got the rank-side forward (``folded``:
    their ids) and whose own forward is the class's."""
    found = []
    for _, layer in plan.layers:
        for module in layer.modules():
            if "forward" in vars(module) or not is_gated_lora_mlp(module):
                continue
            if all(id(getattr(module, name)) in folded for name in ("gate_proj", "up_proj", "down_proj")):
                found.append(module)
    return found


def eager_checks(layer: torch.nn.Module) -> tuple[Callable[[], None], ...]:
    """The host-side checks other optimizations left on the layer's modules (``fallback.EAGER_CHECK_ATTR``: moe4bit's
    check that the experts still hold the stacks its plan was built from): their traced forwards skip them, so the
    eager wrapper runs them before the compiled code; each reports through its own optimization's fallback."""
    return tuple(check for m in layer.modules() if callable(check := vars(m).get(EAGER_CHECK_ATTR)))


def kernel_forwards(plan: CompilePlan) -> list[torch.nn.Module]:
    """Modules inside the layers whose forward another leantrain optimization bound on the instance (layer_kernels'
    Liger RMSNorm / SwiGLU / RoPE forwards: Dynamo failed on Liger's RMSNorm autograd function with an AssertionError
    on torch 2.11, H200, when the checkpoint was traced in the same region; with the checkpoint outside it is not
    measured yet, so the stock forwards run and inductor fuses them), in the order found. Forwards marked
    traceable (``fallback.TRACEABLE_ATTR``: moe4bit's grouped experts, whose kernels are custom ops) stay."""
    found = []
    for _, layer in plan.layers:
        for module in layer.modules():
            bound = vars(module).get("forward") if module is not layer else None
            func = getattr(bound, "__func__", bound)
            if func is None or getattr(func, TRACEABLE_ATTR, False):
                continue
            if getattr(func, "__module__", "").startswith("leantrain.") or hasattr(func, "__leantrain_original__"):
                found.append(module)
    return found
