"""The package version (one place: the entry point and the run record both read it)."""

__version__ = "0.1.0"
