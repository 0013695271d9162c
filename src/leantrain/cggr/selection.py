"""Which labels CGGR keeps: per-sequence (per-document when packed) exact top-k over valid label positions.

Everything here is vectorized and free of host syncs. The kept count of a group with ``n`` valid labels is
``ceil(ratio * n)`` computed in float64 (the same value as Python's ``math.ceil(ratio * n)``), so the number of kept
labels is known from the labels alone, before any scoring: the loss denominator can be set exactly in advance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


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
