"""The command line: ``leantrain run``, ``compare``, ``demo`` and ``env``. It sits on top of the library and only
calls its public entry point; nothing below imports it."""

from .commands import main


__all__ = ["main"]
