"""The packed attention of ``padding_free``'s varlen plan, on CPU: the rows' boundaries, SDPA over their mask against
each row's own causal SDPA, and the adapter to torch's ``varlen_attn`` for each of its signatures (a stand-in kernel
that records what it is given and computes row by row). The flash kernel itself runs on CUDA only:
tests/gpu/test_padding_free_cuda.py compares it with the padded batch there.

Bounds (fp32): the packed row's attention sums each query's keys in another order than the row's own SDPA (a longer
key axis, masked), so they agree to rounding: each output within 8 ulps of the output's largest entry (outputs are
O(1) averages of the values)."""

from __future__ import annotations

import inspect

import pytest
import torch

from leantrain.padding_free.ops import boundaries, packed_causal_attention, segment_mask, varlen_kernel


LENGTHS = (5, 11, 1, 7)
EPS = torch.finfo(torch.float32).eps


def qkv(heads: int = 4, kv_heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    total = sum(LENGTHS)
    return tuple(torch.randn(1, h, total, dim) for h in (heads, kv_heads, kv_heads))


def row_by_row(query, key, value, scale=None) -> torch.Tensor:
    """Each row's causal SDPA on its own, the rows concatenated: (1, T, H, D)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    outs, start = [], 0
    for n in LENGTHS:
        rows = slice(start, start + n)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, rows], key[:, :, rows], value[:, :, rows], is_causal=True, scale=scale
            )
        )
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def cu() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


def test_boundaries_of_packed_position_ids():
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    out = boundaries(positions)
    assert out.dtype == torch.int32 and out.tolist() == cu().tolist()


def test_the_segment_mask_keeps_each_row_causal_and_to_itself():
    mask = segment_mask(cu(), sum(LENGTHS))
    assert mask[5, 4].item() is False and mask[5, 5].item() is True  # row 2 starts at 5: nothing of row 1
    assert mask[4, 0].item() is True and mask[0, 4].item() is False  # causal inside row 1
    assert int(mask.sum()) == sum(n * (n + 1) // 2 for n in LENGTHS)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_sdpa_over_the_rows_mask_equals_each_rows_own_attention(kv_heads):
    query, key, value = qkv(kv_heads=kv_heads)
    out = packed_causal_attention(query, key, value, cu(), 0.3, None)
    expected = row_by_row(query, key, value, 0.3)
    assert out.shape == expected.shape == (1, sum(LENGTHS), 4, 8)
    assert (out - expected).abs().max() <= 8 * EPS * expected.abs().max()


def stand_in(signature: str, seen: list[dict]):
    """A ``varlen_attn`` of the given signature: records its keyword arguments and the key's heads, and computes
    each row's causal attention (what the flash kernel computes)."""

    def compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        seen.append({**kwargs, "kv_heads": key.shape[1], "max_q": max_q, "same_cu": cu_seq_q is cu_seq_k})
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        return row_by_row(q, k, v, kwargs.get("scale"))[0]

    namespace = {"compute": compute}
    exec(f"def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k{signature}):\n"  # noqa: S102
         f"    return compute(**{{k: v for k, v in locals().items()}})", namespace)  # fmt: skip
    return namespace["varlen_attn"]


@pytest.mark.parametrize(
    ("signature", "causal", "kv_heads_seen", "gqa"),
    [
        (", *, scale=None, window_size=(-1, -1), enable_gqa=False", {"window_size": (-1, 0)}, 2, True),
        (", *, return_aux=None, scale=None, window_size=(-1, -1)", {"window_size": (-1, 0)}, 4, False),
        (", is_causal=False, return_aux=None, scale=None", {"is_causal": True}, 4, False),
    ],
)  # fmt: skip
def test_the_adapter_speaks_each_varlen_attn_signature(signature, causal, kv_heads_seen, gqa):
    seen: list[dict] = []
    kernel = varlen_kernel(stand_in(signature, seen))
    query, key, value = qkv()
    out = packed_causal_attention(query, key, value, cu(), 0.3, kernel)
    assert (out - row_by_row(query, key, value, 0.3)).abs().max() <= 8 * EPS * out.abs().max()
    call = seen[0]
    assert {k: call[k] for k in causal} == causal and call["scale"] == 0.3 and call["same_cu"]
    assert call["kv_heads"] == kv_heads_seen and call.get("enable_gqa", False) is gqa
    assert call["max_q"] == sum(LENGTHS)  # a bound on the longest row: the total, a shape


@pytest.mark.parametrize("signature", ["", ", is_causal=False", ", *, window_size=(-1, -1)"])
def test_no_adapter_without_causal_masking_or_a_scale(signature):
    seen: list[dict] = []
    varlen_attn = stand_in(signature, seen)
    assert inspect.signature(varlen_attn).parameters  # the stand-in has the signature asked for
    assert varlen_kernel(varlen_attn) is None
