"""CGGR's math: which labels to keep (selection) and how hard each token is (scoring). Plain tensors in and out.

**Selection**: Which labels CGGR keeps: per-sequence (per-document when packed) exact top-k over valid label positions.

Everything here is vectorized and free of host syncs. The kept count of a group with ``n`` valid labels is
``ceil(ratio * n)`` computed in float64 (the same value as Python's ``math.ceil(ratio * n)``), so the number of kept
labels is known from the labels alone, before any scoring: the loss denominator can be set exactly in advance.

**Scoring**: token difficulty scores from a decoder layer's hidden state: final norm -> LM head -> logit scale /
softcap -> score, in fp32, on the valid (label != -100) positions only, in tiles (the full [B, T, V] logits never
exist). Higher score = harder = kept first.

- ``entropy``: entropy of the next-token distribution.
- ``loss``: cross-entropy of the actual next token.
- ``margin``: minus the top-1/top-2 probability margin (a small margin is an uncertain token).
- ``combined``: z-scored entropy plus z-scored (minus) margin, statistics over the valid positions of each row.

Only valid positions are scored: they are gathered (a stable sort of the validity mask, no host sync) into a prefix
whose length is the valid count. That count is a host integer, so the gathered size is static: the CGGR runtime copies
it to host memory without blocking before the forward starts (``patch.HostCount``) and the router only waits for that
copy, never for the forward itself. Padding and prompt positions cost no LM-head GEMM.

``entropy`` and ``loss`` go through leantrain's fused no-grad log-prob/entropy kernel (``lm_head.ops``: Triton fold
over cuBLAS tiles on CUDA, torch tiles elsewhere; a sibling package, imported here on purpose) when the head is a plain
bias-free ``nn.Linear``. ``margin`` needs the second-largest probability, which that kernel does not track, and heads
wrapped by PEFT or quantization (or with a bias) use a torch path that calls the head module itself in row chunks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..models import DecoderParts, text_config


IGNORE_INDEX = -100


def schedule_ratio(step: int, ratio: float, warmup: int, schedule: str) -> float:
    """Keep ratio at optimizer step ``step``: 1.0 during warmup (``constant``) or a linear ramp 1 -> ratio."""
    if step >= warmup:
        return ratio
    if schedule == "linear":
        return 1.0 - (step / warmup) * (1.0 - ratio)
    return 1.0


def targets_of(batch: Mapping[str, Any]) -> torch.Tensor:
    """The label tensor aligned with hidden positions: ``shift_labels`` as given, else a view ``labels[:, 1:]``.

    Position ``t`` of the result is the target predicted from hidden position ``t`` (causal shift). Being a view,
    writing -100 into it masks the batch's own label tensor in place.
    """
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    return batch["labels"][:, 1:]


def groups_of(batch: Mapping[str, Any], width: int) -> torch.Tensor | None:
    """Per-position document ids when the batch carries ``position_ids`` (packed / padding-free rows), else None.

    A document starts where ``position_ids == 0``; ids are taken at the scoring position (the label positions where
    a new document starts are -100 in packed batches, so either side of the shift gives the same counts).
    """
    position_ids = batch.get("position_ids")
    if position_ids is None or not torch.is_tensor(position_ids) or position_ids.dim() != 2:
        return None
    return torch.cumsum(position_ids[:, :width] == 0, dim=1)


def group_counts(valid: torch.Tensor, groups: torch.Tensor | None, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups [B, T] int64, keep count per (row, group id) [B, T + 1]); group ids lie in [0, T]."""
    rows, width = valid.shape
    if groups is None:
        groups = torch.zeros_like(valid, dtype=torch.long)
    n_valid = torch.zeros(rows, width + 1, dtype=torch.long, device=valid.device)
    n_valid.scatter_add_(1, groups, valid.long())
    keep = torch.ceil(n_valid.double() * ratio).long() if ratio < 1.0 else n_valid
    return groups, keep


def kept_per_row(targets: torch.Tensor, groups: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """Number of labels CGGR keeps in each row: sum over its documents of ``ceil(ratio * n_valid)``."""
    _, keep = group_counts(targets != IGNORE_INDEX, groups, ratio)
    return keep.sum(dim=1)


def select_topk(scores: torch.Tensor, valid: torch.Tensor, groups: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """Boolean keep mask [B, T]: in each (row, group), the ``ceil(ratio * n_valid)`` valid positions of highest score.

    Ties go to the earlier position; NaN scores rank last; invalid positions are never kept. Three stable sorts
    order each row by (group, valid first, score descending, position); the rank inside a group is the distance to
    the group's first slot in that order.
    """
    groups, keep_count = group_counts(valid, groups, ratio)
    scores = scores.float().nan_to_num(nan=-math.inf)
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    order = order.gather(1, torch.argsort((~valid.gather(1, order)).to(torch.uint8), dim=1, stable=True))
    order = order.gather(1, torch.argsort(groups.gather(1, order), dim=1, stable=True))
    sorted_groups = groups.gather(1, order).contiguous()
    first = torch.searchsorted(sorted_groups, sorted_groups)
    rank = torch.arange(scores.shape[1], device=scores.device) - first
    keep_sorted = rank < keep_count.gather(1, sorted_groups)
    return torch.zeros_like(valid).scatter_(1, order, keep_sorted)


def count_stand_in(targets: torch.Tensor, groups: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """A label-shaped tensor whose non -100 count per row equals the kept count: lets transformers' own
    ``_get_num_items_in_batch`` count (and gather across ranks) the kept labels exactly."""
    kept = kept_per_row(targets, groups, ratio)
    columns = torch.arange(targets.shape[1], device=targets.device)
    return torch.where(columns < kept[:, None], 0, IGNORE_INDEX)


SCORINGS = (
    "entropy",
    "margin",
    "loss",
    "combined",
    "random",
)  # config.CGGR_SCORINGS offers these (a test keeps them equal)
_CHUNK_ELEMENTS = 1 << 25  # logits per torch-path chunk: 128 MiB of fp32 per temporary


def _norm(parts: DecoderParts, hidden: torch.Tensor) -> torch.Tensor:
    return parts.final_norm(hidden) if parts.final_norm is not None else hidden


def _transform(logits: torch.Tensor, parts: DecoderParts) -> torch.Tensor:
    z = logits.float()
    if parts.logit_scale != 1.0:
        z = z * parts.logit_scale
    if parts.softcap is not None:
        z = torch.tanh(z / parts.softcap) * parts.softcap
    return z


def fused_ok(parts: DecoderParts, scoring: str) -> bool:
    """Whether ``scoring`` runs through the fused log-prob/entropy kernel for this head."""
    head = parts.lm_head
    return scoring in ("entropy", "loss") and type(head) is nn.Linear and head.bias is None


def _fused_scores(parts: DecoderParts, hidden: torch.Tensor, targets: torch.Tensor, scoring: str) -> torch.Tensor:
    from ..lm_head.ops import logp_entropy  # the shared LM-head math

    log_probs, entropy = logp_entropy(
        _norm(parts, hidden),
        parts.lm_head.weight,
        targets,
        logit_scale=parts.logit_scale,
        softcap=parts.softcap,
        need_entropy=scoring == "entropy",
    )
    return entropy if scoring == "entropy" else -log_probs


def _chunk_scores(parts: DecoderParts, hidden: torch.Tensor, targets: torch.Tensor, scoring: str) -> torch.Tensor:
    """[n] scores of one chunk of [n, H] hidden rows ([n, 2] entropy and margin for ``combined``)."""
    z = _transform(parts.lm_head(_norm(parts, hidden)), parts)
    lse = torch.logsumexp(z, dim=-1)
    if scoring == "loss":
        return lse - z.gather(1, targets[:, None]).squeeze(1)
    probs = torch.exp(z - lse[:, None])
    entropy = lse - (probs * z).sum(-1)
    if scoring == "entropy":
        return entropy
    top2 = probs.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    return -margin if scoring == "margin" else torch.stack((entropy, margin), dim=-1)


def score_rows(
    parts: DecoderParts, hidden: torch.Tensor, targets: torch.Tensor, scoring: str, chunk_tokens: int | None = None
) -> torch.Tensor:
    """fp32 scores of [n, H] hidden rows whose targets [n] are all valid: [n], or [n, 2] for ``combined``."""
    if fused_ok(parts, scoring):
        return _fused_scores(parts, hidden, targets, scoring).float()
    vocab = parts.lm_head.weight.shape[0] if hasattr(parts.lm_head, "weight") else 1 << 17
    step = chunk_tokens or max(1, _CHUNK_ELEMENTS // vocab)
    pieces = [
        _chunk_scores(parts, hidden[start : start + step], targets[start : start + step], scoring)
        for start in range(0, hidden.shape[0], step)
    ]
    if not pieces:
        return hidden.new_zeros((0, 2) if scoring == "combined" else (0,), dtype=torch.float)
    return torch.cat(pieces).float()


def _zscore(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row z-score over the valid positions (population std, floored so a constant row gives zeros)."""
    weight = valid.float()
    count = weight.sum(dim=1, keepdim=True).clamp(min=1.0)
    mean = (values * weight).sum(dim=1, keepdim=True) / count
    var = ((values - mean).square() * weight).sum(dim=1, keepdim=True) / count
    return (values - mean) / var.sqrt().clamp(min=1e-6)


def valid_positions(valid: torch.Tensor, n_valid: int) -> torch.Tensor:
    """Flat indices of the ``n_valid`` true entries of ``valid`` [B, T'], in order: a stable sort puts them first
    (no host sync; ``n_valid`` must be the exact count)."""
    return torch.argsort((~valid.reshape(-1)).to(torch.uint8), stable=True)[:n_valid]


@torch.no_grad()
def score_tokens(
    parts: DecoderParts,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    scoring: str,
    chunk_tokens: int | None = None,
    n_valid: int | None = None,
) -> torch.Tensor:
    """fp32 scores [B, T'] for hidden positions ``0..T'-1`` (``T' = targets.shape[1]``; targets aligned to them).

    Invalid positions (target -100) are not scored and get 0 (selection never keeps them). ``n_valid``: the number
    of valid targets as a host integer; without it it is read from the device (a host sync).
    """
    if scoring not in SCORINGS or scoring == "random":
        raise ValueError(f"cannot score with {scoring!r}")
    rows, width = targets.shape
    valid = targets != -100
    if n_valid is None:
        n_valid = int(valid.sum())
    index = valid_positions(valid, n_valid)
    # Hidden rows in place: flat target index b * T' + t is hidden row b * T + t (no copy of hidden[:, :T'])
    seq = hidden.shape[1]
    hidden_index = index if seq == width else index + (index // width) * (seq - width)
    rows_h = hidden.detach().reshape(rows * seq, hidden.shape[-1]).index_select(0, hidden_index)
    scored = score_rows(parts, rows_h, targets.reshape(-1).index_select(0, index), scoring, chunk_tokens)
    out = scored.new_zeros((rows * width, *scored.shape[1:])).index_copy_(0, index, scored)
    if scoring != "combined":
        return out.view(rows, width)
    out = out.view(rows, width, 2)
    return torch.where(valid, _zscore(out[..., 0], valid) - _zscore(out[..., 1], valid), 0.0)


def random_scores(shape: tuple[int, int], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform scores for the random-selection control, from a private generator (the training RNG is untouched)."""
    return torch.rand(shape, generator=generator, device=device)


def head_share(config) -> float:
    """Estimated share of the LM head in per-token forward matmul MACs (attention-score term left out)."""
    text = text_config(config)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    vocab = text.vocab_size
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    top_k = getattr(text, "num_experts_per_tok", None)
    if top_k:  # MoE: the routed experts' matmuls (gpt-oss keeps the per-expert width in intermediate_size)
        per_expert = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
        mlp = top_k * 3 * hidden * per_expert
    elif getattr(text, "model_type", "") in ("gpt2", "gpt_neox"):
        inner = getattr(text, "n_inner", None) or getattr(text, "intermediate_size", None) or 4 * hidden
        mlp = 2 * hidden * inner
    else:
        inner = getattr(text, "intermediate_size", None) or 4 * hidden
        mlp = 3 * hidden * inner
    head = vocab * hidden
    return head / (head + layers * (attention + mlp))
