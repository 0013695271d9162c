"""Private code objects for ``torch.compile``: plain functions in, plain functions out (imports nothing of leantrain).

Dynamo keeps its compiled entries on the *code object* it compiled. Compiling a class's own ``forward`` (or
``nn.Module.__call__``, which every module shares) would share those entries, and torch's per-code recompile limit,
with every other ``torch.compile`` of that code in the process, and they would outlive ``unpatch_trainer``.
:func:`private_copy` gives each install its own code object with the same bytecode, globals, defaults and closure,
which goes away with the patch."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


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
