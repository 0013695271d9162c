"""Placeholder: this optimization registers itself here once built."""
