"""The run-time fallback guard: an optimized path that fails unexpectedly warns once and serves the stock path."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable
from typing import Any


logger = logging.getLogger("leantrain")


class UserInputError(ValueError):
    """A mistake in the user's input: never swallowed by the run-time fallback."""


def _control_flow_errors() -> tuple[type[BaseException], ...]:
    # Non-reentrant activation checkpointing stops a recomputation early by raising this from inside the
    # checkpointed forward: it is control flow, not a failure of the optimized path.
    import torch.utils.checkpoint as checkpoint

    stop = getattr(checkpoint, "_StopRecomputationError", None)
    return (UserInputError, stop) if stop is not None else (UserInputError,)


_CONTROL_FLOW = _control_flow_errors()


def recomputing() -> bool:
    """Whether this call runs inside a backward pass (a checkpoint's recompute), read from autograd's engine."""
    import torch

    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def compiling() -> bool:
    """Whether Dynamo is tracing this call."""
    import torch

    check = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(check is not None and check())


# What an optimization leaves on the modules it patched for a compiled region around them (no optimization imports
# another, so these names are the whole protocol):
# - on a forward it binds on an instance: Dynamo traces that forward as is (a compiled layer keeps it);
TRACEABLE_ATTR = "__leantrain_traceable__"
# - on a module: a host-side check, called with no arguments, that its forward skips while Dynamo traces (the check
#   reads what a trace cannot, such as data pointers and in-place versions). Whoever compiles code that runs the
#   module calls it eagerly before each compiled call; the check reports a failure through its own optimization's
#   run-time fallback, so a failed check sends that optimization to its stock path.
EAGER_CHECK_ATTR = "_leantrain_eager_check"


class RuntimeFallback:
    """Runs an optimized path; on its first unexpected error warns once and serves the stock path from then on.

    ``on_failure`` lets patch_trainer record the failure in the trainer's report. In strict mode the error re-raises.
    """

    def __init__(self, name: str, strict: bool, on_failure: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.strict = strict
        self.on_failure = on_failure
        self.failed: str | None = None
        self._took: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def call_at(
        self, site: Any, fast: Callable[..., Any], stock: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        """``call`` for a site inside checkpointed layers (a module, or a function made for one module): a recompute
        in the backward takes the path the site's own forward took. The fallback may trip at a later site of the same
        forward; non-reentrant checkpointing stops training when a recompute saves other tensors than its forward."""
        if compiling():  # traced by Dynamo (a user's compiled region): the graph holds one path, nothing to track
            return self.call(fast, stock, *args, **kwargs)
        took = self._took.get(site) if recomputing() else None
        if took is not None:
            return (fast if took else stock)(*args, **kwargs)
        out, took_fast = self._run(fast, stock, args, kwargs)
        # took_fast even where the fallback tripped inside the fast path and it still ran to the end (a compile past
        # the recompile limit): its recompute must run it again to save the same tensors
        self._took[site] = took_fast
        return out

    def call(self, fast: Callable[..., Any], stock: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._run(fast, stock, args, kwargs)[0]

    def _run(
        self, fast: Callable[..., Any], stock: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, bool]:
        """The result, and whether the fast path produced it."""
        if self.failed is not None:
            return stock(*args, **kwargs), False
        try:
            return fast(*args, **kwargs), True
        except _CONTROL_FLOW:
            raise
        except Exception as error:
            if self.strict:
                raise
            self.fail(f"{type(error).__name__}: {error}")
            return stock(*args, **kwargs), False

    def fail(self, reason: str) -> None:
        if self.failed is not None:
            return
        self.failed = reason
        message = (
            f"leantrain: {self.name} failed at run time ({reason}); using the stock path for the rest of training"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.warning(message)
        if self.on_failure is not None:
            self.on_failure(reason)
