"""leantrain: one call after the trainer is built makes Hugging Face / TRL fine-tuning faster and leaner."""

from ._version import __version__
from .config import LeantrainConfig
from .entry import NotReadyError, current_report, patch_trainer, patched, trainer_kind, unpatch_trainer
from .report import PatchOutcome, PatchReport, Status


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


def __getattr__(name: str):
    # Lazy: the MoE module imports bitsandbytes only when asked for.
    if name == "quantize_experts_4bit":
        from .moe4bit import quantize_experts_4bit

        return quantize_experts_4bit
    if name == "expert_lora_targets":
        from .moe4bit import expert_lora_targets

        return expert_lora_targets
    raise AttributeError(name)
