"""Trainer glue: TRL's collator batches padding-free from the next batch on; with the varlen plan, the model's SDPA is
swapped for ``packed_attention`` (flash attention over the rows' boundaries, which the collator sends) under a name
of transformers' attention registries. The undo restores the padded batches and the model's SDPA."""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..models import unwrap_model
from ..undo import Undo
from .ops import boundaries, packed_causal_attention, varlen_kernel
from .probe import HALF, PaddingFreePlan


ATTENTION = "leantrain_packed_sdpa"  # the name the model's config selects while the plan is applied
VARLEN = varlen_kernel()  # resolved once: a compiled layer sees a constant
# the flash-attention keyword arguments that only transformers' own flash path reads: as Python ints they would be
# a new constant of a compiled layer at every batch
UNREAD = ("max_length_q", "max_length_k")


def install(plan: PaddingFreePlan, undo: Undo) -> tuple[str, ...]:
    undo.set_attr(plan.collator, "padding_free", True)
    if plan.trainer_flag:  # SFTTrainer keeps its own copy of the flag (read by its metrics); kept in step
        undo.set_attr(plan.trainer, "padding_free", True)
    if not plan.varlen:
        return (type(plan.collator).__name__,)
    undo.wrap_method(plan.collator, "torch_call", with_boundaries)
    register()
    config = unwrap_model(plan.trainer.model).config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION  # a property: the undo sets it back rather than popping an attribute
    undo.push(lambda: setattr(config, "_attn_implementation", previous))
    return (type(plan.collator).__name__, ATTENTION)


def with_boundaries(torch_call: Any) -> Any:
    """The collator's batches with ``cu_seq_lens_q`` / ``_k`` (the rows' ``boundaries``) where this TRL does not
    send them: counted on the host from its CPU position ids, no GPU sync in the step."""

    def call(examples: list[Any]) -> dict[str, Any]:
        batch = torch_call(examples)
        if "position_ids" in batch and "cu_seq_lens_q" not in batch:
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = boundaries(batch["position_ids"])
        for name in UNREAD:
            batch.pop(name, None)
        return batch

    return call


def register() -> None:
    """``ATTENTION`` in transformers' attention and mask registries. The names stay registered after the undo (a
    definition no config selects any more); the model's config switching to them is what the undo takes back."""
    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, packed_mask)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A packed batch (the collator's ``cu_seq_lens_q``, no mask) through ``ops.packed_causal_attention`` (flash
    attention where CUDA runs 16 bits, else SDPA over the rows' mask); any other call is transformers' SDPA."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None or attention_mask is not None or query.shape[0] != 1:
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    varlen = VARLEN if query.is_cuda and query.dtype in HALF else None
    return packed_causal_attention(query, key, value, cu_seqlens, scaling, varlen), None


def packed_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask for a batch without padding whose queries are its keys (a training batch, packed or not):
    ``packed_attention`` keeps the rows apart by their boundaries, or is causal SDPA; else transformers' SDPA mask."""
    if attention_mask is None and kwargs.get("q_length") == kwargs.get("kv_length") and not kwargs.get("q_offset"):
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](attention_mask=attention_mask, **kwargs)
