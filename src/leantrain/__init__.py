"""leantrain: one call after the trainer is built makes Hugging Face / TRL fine-tuning faster and leaner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .config import LeantrainConfig
from .report import PatchOutcome, PatchReport, Status


if TYPE_CHECKING:
    from .entry import NotReadyError, current_report, patch_trainer, patched, trainer_kind, unpatch_trainer
    from .moe4bit import expert_lora_targets, quantize_experts_4bit


__all__ = [
    "LeantrainConfig",
    "NotReadyError",
    "PatchOutcome",
    "PatchReport",
    "Status",
    "current_report",
    "patch_trainer",
    "patched",
    "trainer_kind",
    "unpatch_trainer",
    "quantize_experts_4bit",
    "expert_lora_targets",
]
# Loaded on first use (PEP 562): the entry point imports torch, which the command line's --help must not wait for;
# the MoE module imports bitsandbytes only when asked for.
_ENTRY = ("NotReadyError", "current_report", "patch_trainer", "patched", "trainer_kind", "unpatch_trainer")
_MOE4BIT = ("quantize_experts_4bit", "expert_lora_targets")


def __getattr__(name: str) -> Any:
    if name in _ENTRY:
        from . import entry

        value = getattr(entry, name)
    elif name in _MOE4BIT:
        from . import moe4bit

        value = getattr(moe4bit, name)
    else:
        raise AttributeError(f"module 'leantrain' has no attribute {name!r}")
    globals()[name] = value  # cached: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
