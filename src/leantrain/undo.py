"""Instance-scoped patching with exact undo: every change an optimization makes is one restore action."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


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
