"""Random token rows and the right-padding collator the compiled-layer tests and probe share: pad id 0, mask 0,
label -100 on the padding, so a stock run and a patched run see the same batches."""

from __future__ import annotations

import torch


def random_rows(n: int, lengths: tuple[int, ...], vocab: int, seed: int = 5) -> list[dict[str, list[int]]]:
    """``n`` rows of token ids in [3, vocab), their lengths cycling through ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()} for i in range(n)
    ]


def pad_right(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest row."""
    width = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
