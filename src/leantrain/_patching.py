"""Instance-scoped patching with exact undo, and the run-time fallback guard."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any


logger = logging.getLogger("leantrain")
_MISSING = object()


class Undo:
    """A stack of restore actions; calling it runs them newest first, once."""

    def __init__(self) -> None:
        self._actions: list[Callable[[], None]] = []

    def push(self, action: Callable[[], None]) -> None:
        self._actions.append(action)

    def extend(self, other: Undo) -> None:
        self._actions.extend(other._actions)
        other._actions = []

    def __call__(self) -> None:
        while self._actions:
            self._actions.pop()()

    def __len__(self) -> int:
        return len(self._actions)

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name`` and remember whether the old value lived in the instance dict (or only on the class)."""
        old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name)

        def restore() -> None:
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, old)

        setattr(obj, name, value)
        self.push(restore)

    def wrap_method(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Bind ``make(original_bound_method)`` on the instance; the original is restored by identity on undo."""
        original = getattr(obj, name)
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        wrapper.__leantrain_original__ = original  # type: ignore[attr-defined]
        self.set_attr(obj, name, wrapper)

    def add_callback(self, trainer: Any, callback: Any) -> None:
        trainer.add_callback(callback)
        self.push(lambda: trainer.remove_callback(callback))


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
