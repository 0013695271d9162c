"""The padding-free probe: is the trainer's collator TRL's language-modeling collator, batching padded rows (not
packed, more than one row a batch); does the model's attention keep packed rows apart from their position ids; does
the trainer count the loss's tokens after the shift (so the loss is normalized as for the padded batch); and does the
collator's padding-free output hold what that needs (checked on a two-row batch). Auto mode leaves it off until it is
measured faster than padded batches (``AUTO_RULE``)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass
from typing import Any

from ..models import unwrap_model
from ..optimization import PatchContext, Readiness
from .ops import packed_batch_problems


# transformers builds the mask of packed rows from the position ids (masking_utils) for these
MASKED_FROM_POSITIONS = ("sdpa", "eager", "flex_attention")
AUTO_RULE = "padding-free batches are not yet measured faster than padded ones on a training step"


@dataclass(frozen=True)
class PaddingFreePlan:
    trainer: Any
    collator: Any  # TRL's DataCollatorForLanguageModeling, whose padding_free flag apply turns on
    trainer_flag: bool  # the trainer has its own padding_free attribute (SFTTrainer)
    attention: str  # the model's attention implementation


def probe(trainer: Any, ctx: PatchContext) -> Readiness:
    collator = trainer.data_collator
    if type(collator).__name__ != "DataCollatorForLanguageModeling" or not hasattr(collator, "padding_free"):
        return Readiness.not_applicable(
            f"the trainer's collator is {type(collator).__name__}, not TRL's DataCollatorForLanguageModeling: "
            "padding_free switches that collator's batches"
        )
    if collator.padding_free:
        return Readiness.not_applicable("the trainer batches padding-free already (SFTConfig padding_free or packing)")
    if getattr(trainer.args, "packing", False):
        return Readiness.not_applicable("packing=True: the trainer packs rows itself")
    if trainer.args.per_device_train_batch_size < 2:
        return Readiness.not_applicable("one row a batch (per_device_train_batch_size=1): no padding to drop")
    model = unwrap_model(trainer.model)
    reasons = model_reasons(model) + count_reasons(trainer) + collator_reasons(collator)
    if reasons:
        return Readiness.no(*reasons).with_auto_rule(AUTO_RULE)
    plan = PaddingFreePlan(trainer, collator, hasattr(trainer, "padding_free"), attention_of(model))
    return Readiness(detail=describe(plan), plan=plan).with_auto_rule(AUTO_RULE)


def attention_of(model: Any) -> str:
    return str(getattr(getattr(model, "config", None), "_attn_implementation", None))


def model_reasons(model: Any) -> list[str]:
    """Why the model's attention would not keep packed rows apart (or could not take position ids)."""
    attention = attention_of(model)
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params:
        return [f"{type(model).__name__}.forward takes no position_ids: packed rows would share one position range"]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return [f"{type(model).__name__}.forward takes no **kwargs for the collator's sequence boundaries"]
    if attention.startswith("flash_attention"):
        return []  # flash attention's varlen path reads the collator's sequence boundaries
    if attention not in MASKED_FROM_POSITIONS:
        return [f"attention {attention!r}: padding_free serves {', '.join(MASKED_FROM_POSITIONS)} and flash attention"]
    masking = sys.modules.get("transformers.masking_utils")
    module = sys.modules.get(type(model).__module__)
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        return ["this transformers builds no masks of packed rows from position ids (masking_utils)"]
    if module is None or not hasattr(module, "create_causal_mask"):
        return [
            f"{type(model).__name__} does not build its mask with transformers' create_causal_mask: packed rows "
            "would attend to each other"
        ]
    return []


def count_reasons(trainer: Any) -> list[str]:
    """The trainer's token count for the loss must be the one of the padded batch: counted after the causal shift
    (the padding-free batch ignores every row's first label, which the shift drops from the padded one)."""
    counts = getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None)
    if counts and getattr(trainer, "_loss_shifts_labels", None) is not True:
        return [
            "this transformers Trainer counts the loss's tokens before the causal shift: padding-free batches "
            "(every row's first label ignored) would scale the loss unlike padded ones"
        ]
    return []


def collator_reasons(collator: Any) -> list[str]:
    """The collator's padding-free output on two examples, checked by ``ops.packed_batch_problems``."""
    examples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    try:
        out = dataclasses.replace(collator, padding_free=True)(examples)
    except Exception as error:  # a collator of another version or shape: say so rather than guess
        return [f"TRL's collator failed on a padding-free check batch ({type(error).__name__}: {error})"]
    problems = packed_batch_problems(out, [len(e["input_ids"]) for e in examples])
    return [f"TRL's padding-free batches do not train as padded ones: {p}" for p in problems]


def describe(plan: PaddingFreePlan) -> str:
    how = "sequence boundaries" if plan.attention.startswith("flash_attention") else "masks from the position ids"
    return f"{type(plan.collator).__name__}: each batch one row of real tokens; {plan.attention} attention ({how})"
