"""Padding-free batches: each batch's rows as one row of their real tokens, position ids restarting at every row's
start, so no layer computes or keeps a padding token.

TRL's SFT collator builds such batches itself (its ``padding_free`` flag): the label of every row's first token is
ignored (no row predicts the next one's first token) and no attention mask is sent, so the attention keeps each row to
itself from the position ids (transformers' packed-sequence masks for SDPA, eager and flex attention; the sequence
boundaries for flash attention). The loss and its gradients are the padded batch's: the same targets, the same token
count, each row attending to its own tokens only. ``probe.py`` decides (TRL's collator, no packing, a model whose
attention masks packed rows, a trainer that counts the loss's tokens after the shift; the collator's padding-free
output checked on a two-row batch), ``patch.py`` turns the collator's flag on (on the undo)."""

from __future__ import annotations

from typing import Any

from ..optimization import Applied, Optimization, PatchContext, Readiness, register
from .probe import PaddingFreePlan, describe
from .probe import probe as probe_trainer  # the submodule keeps its name


@register
class PaddingFree(Optimization):
    name = "padding_free"
    trainer_kinds = ("sft",)
    saved_weights = "unchanged: the optimization lays out the batches, not the model"

    def probe(self, trainer: Any, ctx: PatchContext) -> Readiness:
        return probe_trainer(trainer, ctx)

    def apply(self, trainer: Any, plan: PaddingFreePlan, ctx: PatchContext) -> Applied:
        from .patch import install

        return Applied(install(plan, ctx.undo), describe(plan))


__all__ = ["PaddingFree", "PaddingFreePlan"]
