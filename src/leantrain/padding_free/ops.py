"""What a padding-free batch must hold to train as the padded one, in plain tensors: one row of every example's
tokens, position ids restarting at each example's start, each example's first label ignored (no example predicts
the next one's first token), and no attention mask (with one, attention would ignore the position ids)."""

from __future__ import annotations

import torch


IGNORE = -100


def packed_batch_problems(batch: dict[str, torch.Tensor], lengths: list[int]) -> list[str]:
    """Why ``batch`` (a collator's padding-free output for examples of ``lengths`` tokens) is not a correct packed
    row; empty when it is."""
    positions, labels = batch.get("position_ids"), batch.get("labels")
    if "attention_mask" in batch:
        return ["it sends an attention mask, which makes the model ignore the position ids"]
    if positions is None or labels is None:
        return ["it sends no position ids or labels"]
    expected = torch.cat([torch.arange(n) for n in lengths])[None]
    if positions.shape != expected.shape or not torch.equal(positions.cpu(), expected):
        return ["its position ids do not restart at each example's start"]
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    if bool((labels[0, starts[1:]] != IGNORE).any()):
        return ["it keeps each example's first label: examples would predict each other"]
    return []
