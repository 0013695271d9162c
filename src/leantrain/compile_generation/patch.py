"""The wrapped ``generate`` ``apply`` binds on the model instance TRL generates with (never on the class).

A call that carries TRL's own generation config (recognized by identity: evaluation or user calls pass through
untouched) runs transformers' ``generate`` with a copy of that config that turns on its compiled decode step
(``compile_config``, prefill eager) and a static KV cache leantrain sizes: prompt + ``max_new_tokens`` positions,
rounded up to a multiple of 64 and grown geometrically (``ops.cache_length``), so prompts of varying length reuse one
compiled decode step. The cache is built per call and dropped after it, as stock's dynamic cache is. Sampling,
stopping and the logits processors stay transformers' own, eager: the same seed draws the same tokens.

Gradient checkpointing adds a forward hook on the input embeddings each time TRL turns it back on after generating
(transformers' ``enable_input_require_grads`` does not remove the previous one), so their number grows every step;
Dynamo guards on it and would recompile every call. Under ``no_grad`` those hooks change nothing, so they are set
aside for the call and put back after it, in their order.

Every call runs through the run-time fallback: a compile or capture error, or running out of memory for the cache,
warns once and stock ``generate`` serves the rest of training. The compile backend counts compiles: past the limit
the stock path takes over (warned once) before torch's own limit would silently run the decode step eagerly."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..compiling import CountingBackend, private_copy, warm_compile_workers
from ..fallback import RuntimeFallback
from ..models import unwrap_model
from ..report import size_text
from ..undo import Undo
from .ops import cache_length
from .probe import GenerationPlan


logger = logging.getLogger("leantrain")
STATS_ATTR = "leantrain_compile_generation"  # on the trainer: the live DecodeStats
# transformers' enable_input_require_grads and PEFT's prepare_model_for_kbit_training name their hooks so
INPUT_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")
# what transformers' generate keeps on the model for its compiled decode step (set by the patch, restored by undo)
COMPILE_STATE = ("_compiled_call", "_last_compile_config")


class RecompileLimit(RuntimeError):
    """Strict mode: the decode step recompiled more often than ``compile_generation_max_recompiles`` allows."""


class DecodeStats(CountingBackend):
    """Counts the graphs compiled for the decode step (its backend is the counting wrapper) and the caches built;
    past the recompile limit stock generate serves the rest of training."""

    what = "compile_generation: the decode step"

    def __init__(self, plan: GenerationPlan, fallback: RuntimeFallback, cuda_graphs: bool) -> None:
        super().__init__(inner_backend(plan.backend, cuda_graphs), plan.max_recompiles)
        self.plan, self.fallback = plan, fallback
        self.calls = 0
        self.lengths: dict[int, int] = {}  # cache length per batch size
        self.cache_bytes = 0  # the largest cache built

    def past_limit(self, recompiles: int) -> None:
        reason = (
            f"the decode step recompiled {recompiles} times (compile_generation_max_recompiles="
            f"{self.plan.max_recompiles}): new batch sizes or prompt lengths past the cache keep compiling, so "
            "stock generate serves the rest of training; raise the limit if the run's prompts vary widely"
        )
        if self.fallback.strict:
            raise RecompileLimit(reason)
        self.fallback.fail(reason)

    def cache_for(self, batch: int, needed: int) -> int:
        length = cache_length(needed, self.lengths.get(batch, 0))
        if length != self.lengths.get(batch):
            self.lengths[batch] = length
            size = self.plan.cache.bytes(batch, length)
            self.cache_bytes = max(self.cache_bytes, size)
            logger.info(
                "leantrain: compile_generation: static KV cache for %d sequences x %d positions (%s)",
                batch,
                length,
                size_text(size),
            )
        return length


def inner_backend(backend: str, cuda_graphs: bool) -> Callable[..., Any]:
    """The backend that compiles each graph: inductor with CUDA graphs (what ``mode="reduce-overhead"`` sets), or the
    named backend as is."""
    if backend != "inductor":
        return torch._dynamo.lookup_backend(backend)
    from torch._inductor.compile_fx import compile_fx

    patches = {"triton.cudagraphs": True} if cuda_graphs else {}
    return lambda gm, example_inputs: compile_fx(gm, example_inputs, config_patches=patches)


def _call_model(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return model(*args, **kwargs)


def compiled_call(base: nn.Module, stats: DecodeStats) -> Callable[..., Any]:
    """The decode step transformers' ``generate`` runs: ``base(...)`` compiled as a private code object, so its
    compiled entries and torch's recompile limit are this patch's own (``nn.Module.__call__``, what transformers would
    compile, is shared by every module in the process) and go away with it."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return stats.backend(gm, example_inputs)

    step = torch.compile(private_copy(_call_model), backend=backend, dynamic=False, fullgraph=False)
    return functools.partial(step, base)


def compiled_config(plan: GenerationPlan) -> Any:
    """A copy of TRL's generation config with transformers' compiled decode step turned on; the cache is passed in."""
    from transformers import CompileConfig

    config = copy.deepcopy(plan.generation_config)
    config.cache_implementation = None
    config.disable_compile = False
    compile_config = CompileConfig(fullgraph=False, dynamic=False, backend=plan.backend, mode=None)
    compile_config._compile_all_devices = True  # the probe decided the device (CPU only on request)
    config.compile_config = compile_config
    return config


@contextlib.contextmanager
def input_grad_hooks_aside(modules: list[nn.Module]) -> Iterator[None]:
    """Set aside the require-grad hooks on ``modules`` for the block; put them back, in order, after it."""
    saved = []
    for module in modules:
        hooks = module._forward_hooks
        if any(getattr(h, "__name__", "") in INPUT_GRAD_HOOKS for h in hooks.values()):
            saved.append((module, dict(hooks)))
            for key in [k for k, h in hooks.items() if getattr(h, "__name__", "") in INPUT_GRAD_HOOKS]:
                del hooks[key]
    try:
        yield
    finally:
        for module, hooks in saved:
            module._forward_hooks.clear()
            module._forward_hooks.update(hooks)


def _input_ids(args: tuple, kwargs: dict) -> torch.Tensor:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("compile_generation: generate was called without a 2-D input_ids tensor")
    return ids


def install(plan: GenerationPlan, undo: Undo, fallback: RuntimeFallback, trainer: Any) -> tuple[str, ...]:
    """Bind the wrapped ``generate`` on the planned model instance (recorded on ``undo``); the qualified names."""
    from transformers import StaticCache

    base = unwrap_model(plan.model)
    stats = DecodeStats(plan, fallback, plan.cuda_graphs)
    config = compiled_config(plan)
    warm_compile_workers(plan.backend, base)
    embeddings = [m for m in (base.get_input_embeddings(),) if m is not None]

    def compiled(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        batch, prompt = _input_ids(args, kwargs).shape
        length = stats.cache_for(batch, prompt + plan.max_new_tokens)
        cache = StaticCache(config=base.config, max_cache_len=length)
        stats.calls += 1
        with input_grad_hooks_aside(embeddings):
            return original(*args, **{**kwargs, "generation_config": config, "past_key_values": cache})

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def generate(*args: Any, **kwargs: Any) -> Any:
            ours = kwargs.get("generation_config") is plan.generation_config and "past_key_values" not in kwargs
            if not ours:  # evaluation or the user's own calls: stock
                return original(*args, **kwargs)
            return fallback.call(lambda *a, **k: compiled(original, *a, **k), original, *args, **kwargs)

        return generate

    # transformers' generate takes the compiled step it finds for this compile config instead of compiling its own
    undo.set_attr(base, "_compiled_call", compiled_call(base, stats))
    undo.set_attr(base, "_last_compile_config", config.compile_config)
    _restore_on_undo(undo, base, "_previous_max_cache_length")
    undo.wrap_method(plan.model, "generate", make)
    undo.set_attr(trainer, STATS_ATTR, stats)
    return (f"{type(plan.model).__name__}.generate",)


def _restore_on_undo(undo: Undo, obj: Any, name: str) -> None:
    missing = object()
    old = obj.__dict__.get(name, missing)

    def restore() -> None:
        if old is missing:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = old

    undo.push(restore)
