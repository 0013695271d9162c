"""What every ``torch.compile`` install of leantrain shares (imports nothing of leantrain): a private code object and
a backend that counts what it compiles.

Dynamo keeps its compiled entries on the *code object* it compiled. Compiling a class's own ``forward`` (or
``nn.Module.__call__``, which every module shares) would share those entries, and torch's per-code recompile limit,
with every other ``torch.compile`` of that code in the process, and they would outlive ``unpatch_trainer``.
:func:`private_copy` gives each install its own code object with the same bytecode, globals, defaults and closure,
which goes away with the patch. :class:`CountingBackend` counts the graphs compiled for that code, so that past a
recompile limit the patch takes the stock path over (warned once) before torch's own limit would make Dynamo run the
code eagerly without a word."""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any


logger = logging.getLogger("leantrain")


def private_copy(func: Callable[..., Any]) -> types.FunctionType:
    """A function equal to ``func`` with its own code object (``code.replace()`` returns a new one)."""
    if not isinstance(func, types.FunctionType):
        raise TypeError(f"expected a plain function, got {type(func).__name__}")
    copy = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = func.__qualname__, func.__doc__, func.__module__
    copy.__dict__.update(func.__dict__)
    return copy


class CountingBackend:
    """A ``torch.compile`` backend (``backend=counter.backend``) that counts the graphs it compiles and hands each to
    ``inner``. Past ``limit`` recompiles it calls :meth:`past_limit` (a subclass warns once and serves the stock path
    from then on, or raises in strict mode) and runs that one graph as traced, uncompiled."""

    what = "the compiled code"  # the log line's subject

    def __init__(self, inner: Callable[..., Any], limit: int) -> None:
        self.inner, self.limit = inner, limit
        self.compiles = 0
        # whether ``inner`` had this graph before (traced again after its entries were dropped): not counted
        self.seen: Callable[[Any, list[Any]], bool] | None = None

    @property
    def recompiles(self) -> int:
        return max(0, self.compiles - 1)

    def past_limit(self, recompiles: int) -> None:
        raise NotImplementedError

    def backend(self, gm: Any, example_inputs: list[Any]) -> Any:
        if self.seen is not None and self.seen(gm, example_inputs):
            return self.inner(gm, example_inputs)
        self.compiles += 1
        if self.recompiles > self.limit:
            self.past_limit(self.recompiles)
            return gm.forward  # this one call runs the traced graph as is; the next ones the stock path
        if self.compiles > 1:
            logger.info("leantrain: %s recompiled (%d recompiles)", self.what, self.recompiles)
        return self.inner(gm, example_inputs)


def warm_compile_workers(backend: str, module: Any) -> bool:
    """Start inductor's Triton compile workers now, at patch time, rather than at the first compile; whether it did.

    torch starts them when the first graph reaches inductor, and a kernel whose turn comes before the pool is ready
    compiles in the main process, one after another: a cold MoE layer spent 6.4 s of its 16.9 s compile so. Started
    while the trainer sets up and Dynamo traces, the pool takes the kernels in parallel. Only inductor on CUDA uses
    it (``module``'s parameters tell the device); ``TORCHINDUCTOR_COMPILE_THREADS=1`` and ``TORCH_WARM_POOL=0`` keep
    torch's own behaviour (no pool)."""
    device_type = next((p.device.type for p in module.parameters()), "cpu")
    if backend != "inductor" or device_type != "cuda":
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    except Exception as error:  # noqa: BLE001 - a private API: the first compile starts the pool as before
        logger.debug("leantrain: inductor's compile workers not started early: %s", error)
        return False
    return True


def unsupported_reason() -> str | None:
    """Why ``torch.compile`` cannot run in this process (this Python, this torch), or None."""
    import sys

    import torch

    if torch._dynamo.is_dynamo_supported():
        return None
    return f"torch.compile is not supported here (Python {sys.version.split()[0]}, torch {torch.__version__})"
