"""The compiled layer function and the pay-back arithmetic, in plain values (functions, numbers, strings).

The layer's forward is compiled as a private copy (``leantrain.compiling.private_copy``): every layer instance of one
model runs that one copy (Dynamo treats the layer's parameters as inputs, so one compiled entry serves all of them),
and it goes away with the patch."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Payback:
    """Whether compiling pays for itself within a run: ``steps`` optimizer steps, each ``saving_ms`` faster, against
    ``compile_s`` seconds of compiling (the first step's extra time)."""

    steps: int
    saving_ms: float
    compile_s: float

    @property
    def break_even(self) -> int:
        """The step count from which the saving exceeds the compile time."""
        if self.saving_ms <= 0:
            return -1
        return int(self.compile_s * 1000.0 / self.saving_ms) + 1

    @property
    def pays(self) -> bool:
        return self.saving_ms > 0 and self.steps * self.saving_ms / 1000.0 > self.compile_s

    def sentence(self) -> str:
        if self.saving_ms <= 0:
            return "compiling measured no saving a step"
        return (
            f"{self.steps} steps x {self.saving_ms:.0f} ms saved = {self.steps * self.saving_ms / 1000.0:.1f} s "
            f"against {self.compile_s:.0f} s of compiling (pays back from step {self.break_even})"
        )


def checkpointing_inner(forward: Callable[..., Any]) -> Callable[..., Any] | None:
    """The layer's own forward when ``forward`` is transformers' ``forward_with_checkpointing`` (recent releases
    replace a ``GradientCheckpointingLayer`` subclass's ``forward`` with it, so the checkpoint runs inside
    ``forward``); None when ``forward`` is the layer's own (older releases checkpoint in ``__call__``)."""
    code = getattr(forward, "__code__", None)
    if code is None or code.co_name != "forward_with_checkpointing" or "forward" not in code.co_freevars:
        return None
    return forward.__closure__[code.co_freevars.index("forward")].cell_contents


def with_inner(wrapper: types.FunctionType, inner: Callable[..., Any]) -> types.FunctionType:
    """A copy of the checkpointing ``wrapper`` that calls ``inner`` where it called the layer's own forward; its other
    free variables (the wrapper itself, for its outermost-wrapper check) are the original's cells."""
    code = wrapper.__code__
    cells = tuple(
        types.CellType(inner) if name == "forward" else cell
        for name, cell in zip(code.co_freevars, wrapper.__closure__, strict=True)
    )
    copy = types.FunctionType(code, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, cells)
    copy.__kwdefaults__ = wrapper.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = wrapper.__qualname__, wrapper.__doc__, wrapper.__module__
    return copy


def recomputing_elementwise(backend: Callable[..., Any]) -> Callable[..., Any]:
    """``backend`` partitioning each graph it compiles with torch's aggressive recomputation: the forward saves only
    what an elementwise op cannot rebuild (matmul, attention and reduction outputs); norms, activations and dtype
    casts are recomputed in the backward (where the default partition saves their outputs to spare that work). The
    switch is set while the graph compiles only (the partition is decided then), so the compiled code pays nothing
    per call and other compiles in the process keep torch's defaults."""

    def compile_graph(gm: Any, example_inputs: list[Any]) -> Any:
        with torch._functorch.config.patch(aggressive_recomputation=True):
            return backend(gm, example_inputs)

    return compile_graph
