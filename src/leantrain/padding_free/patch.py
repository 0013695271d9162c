"""Trainer glue: TRL's collator batches padding-free from the next batch on; the undo restores the padded batches."""

from __future__ import annotations

from ..undo import Undo
from .probe import PaddingFreePlan


def install(plan: PaddingFreePlan, undo: Undo) -> tuple[str, ...]:
    undo.set_attr(plan.collator, "padding_free", True)
    if plan.trainer_flag:  # SFTTrainer keeps its own copy of the flag (read by its metrics); kept in step
        undo.set_attr(plan.trainer, "padding_free", True)
    return (type(plan.collator).__name__,)
