"""What a padding-free batch must hold to train as the padded one, in plain tensors: one row of every example's
tokens, position ids restarting at each example's start, each example's first label ignored (no example predicts
the next one's first token), and no attention mask (with one, attention would ignore the position ids)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

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


def padding_share(lengths: torch.Tensor, batch: int, draws: int = 512, seed: int = 0) -> float:
    """The expected share of padding in batches of ``batch`` rows drawn at random from rows of ``lengths`` tokens,
    each padded to its longest row (the trainer's shuffled batches): ``draws`` batches, all drawn at once."""
    if lengths.numel() <= batch:
        return 1.0 - float(lengths.sum()) / (lengths.numel() * float(lengths.max()))
    generator = torch.Generator().manual_seed(seed)
    picks = torch.rand(draws, lengths.numel(), generator=generator).argsort(dim=1)[:, :batch]
    rows = lengths[picks].double()
    return 1.0 - float(rows.sum() / (rows.amax(dim=1).sum() * batch))


def boundaries(position_ids: torch.Tensor) -> torch.Tensor:
    """``[0, start_2, ..., T]`` (int32): where each row of a packed batch (``position_ids`` of shape (1, T), restarting
    at 0 at every row's start) begins, and the total; computed where the ids are (the collator's CPU tensors)."""
    row = position_ids[0]
    starts = torch.nonzero(row == 0).flatten()
    return torch.cat([starts, starts.new_tensor([row.numel()])]).to(torch.int32)


def segment_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """(T, T) bool: query i may attend to key j (same row of the packed batch, j <= i). No host sync: each token's
    row is a ``searchsorted`` of its index in the row ends."""
    index = torch.arange(length, device=cu_seqlens.device)
    row = torch.searchsorted(cu_seqlens[1:].to(index.dtype), index, right=True)
    return (row[:, None] == row[None, :]) & (index[:, None] >= index[None, :])


def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    varlen: Callable[..., torch.Tensor] | None,
) -> torch.Tensor:
    """Causal attention of a packed batch, each row to itself: ``query`` (1, H, T, D) and ``key`` / ``value``
    (1, H_kv, T, D) in transformers' layout, ``cu_seqlens`` the rows' ``boundaries``; returns (1, T, H, D), the
    layout transformers' attention functions return. ``varlen`` (``varlen_kernel()``) runs flash attention over the
    boundaries, computing no padding and no (T, T) mask; without it, SDPA with the rows' mask (any device or dtype)."""
    if varlen is not None:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, D): no copy for RoPE'd q/k
        return varlen(q, k, v, cu_seqlens, query.shape[2], scale)[None]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    mask = segment_mask(cu_seqlens, query.shape[2])
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def varlen_kernel(varlen_attn: Callable[..., torch.Tensor] | None = None) -> Callable[..., torch.Tensor] | None:
    """``(q, k, v, cu_seqlens, max_len, scale) -> out`` (all (T, heads, D)) on torch's public
    ``torch.nn.attention.varlen.varlen_attn`` (flash attention over sequence boundaries, CUDA, 16-bit), whichever of
    its signatures this torch has (causal as ``window_size=(-1, 0)`` or ``is_causal=True``; grouped key/value heads
    natively where it takes ``enable_gqa``, else repeated); None where torch has none, or one without a ``scale``.
    ``max_len`` may be any bound on the longest row: the total length is one, and a shape, which a compiled layer
    keeps symbolic (a row's real maximum would be a Python int per batch, a recompile each)."""
    if varlen_attn is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    if "scale" not in params:
        return None  # the models' own scale must reach the kernel
    native_gqa = "enable_gqa" in params

    def call(q, k, v, cu_seqlens, max_len, scale):
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and not native_gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        gqa = {"enable_gqa": True} if groups > 1 and native_gqa else {}
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **causal, **gqa)

    return call
