"""The run-time fallback guard: an optimized path that fails unexpectedly warns once and serves the stock path."""

from __future__ import annotations

import logging
import warnings
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


class RuntimeFallback:
    """Runs an optimized path; on its first unexpected error warns once and serves the stock path from then on.

    ``on_failure`` lets patch_trainer record the failure in the trainer's report. In strict mode the error re-raises.
    """

    def __init__(self, name: str, strict: bool, on_failure: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.strict = strict
        self.on_failure = on_failure
        self.failed: str | None = None

    def call(self, fast: Callable[..., Any], stock: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.failed is not None:
            return stock(*args, **kwargs)
        try:
            return fast(*args, **kwargs)
        except _CONTROL_FLOW:
            raise
        except Exception as error:
            if self.strict:
                raise
            self.fail(f"{type(error).__name__}: {error}")
            return stock(*args, **kwargs)

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
