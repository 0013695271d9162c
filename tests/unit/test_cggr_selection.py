"""CGGR selection, counting, schedule and head-share estimate against brute-force references (pure tensors)."""

import math

import pytest
import shapes  # noqa: E402
import torch
import transformers

from leantrain.cggr.ops import (
    count_stand_in,
    groups_of,
    head_share,
    kept_per_row,
    schedule_ratio,
    select_topk,
    targets_of,
)


def reference_keep(scores, valid, groups, ratio):
    """Python loops: per (row, group) keep the ceil(ratio * n_valid) valid positions of highest score, ties to the
    earlier position, NaN last."""
    rows, width = scores.shape
    keep = torch.zeros(rows, width, dtype=torch.bool)
    for b in range(rows):
        ids = [0] * width if groups is None else groups[b].tolist()
        for g in set(ids):
            members = [t for t in range(width) if ids[t] == g and valid[b, t]]
            k = math.ceil(ratio * len(members))

            def key(t):
                s = scores[b, t].item()
                return (1 if math.isnan(s) else 0, -s if not math.isnan(s) else 0.0, t)

            for t in sorted(members, key=key)[:k]:
                keep[b, t] = True
    return keep


def random_case(seed, rows=5, width=23, ties=False, with_groups=False):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many exact ties
        scores = torch.randint(0, 3, (rows, width), generator=g).float()
    else:
        scores = torch.randn(rows, width, generator=g)
    valid = torch.rand(rows, width, generator=g) < 0.7
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    valid &= torch.arange(width) < lengths[:, None]  # right padding
    valid[0] = False  # a row with n_valid = 0
    groups = None
    if with_groups:
        starts = torch.rand(rows, width, generator=g) < 0.15
        starts[:, 0] = True
        groups = torch.cumsum(starts, dim=1)
    return scores, valid, groups


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.7, 0.999, 1.0])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("with_groups", [False, True])
def test_select_matches_brute_force(ratio, ties, with_groups):
    for seed in range(4):
        scores, valid, groups = random_case(seed, ties=ties, with_groups=with_groups)
        got = select_topk(scores, valid, groups, ratio)
        want = reference_keep(scores, valid, groups, ratio)
        assert torch.equal(got, want), (seed, got.int(), want.int())
        assert not (got & ~valid).any()  # never a -100 / padding position
        # at least one per non-empty row (or document), exactly ceil(r * n) per row summed over its documents
        assert torch.equal(got.sum(1), kept_per_row(torch.where(valid, 0, -100), groups, ratio))


def test_ratio_one_keeps_every_valid_label():
    scores, valid, _ = random_case(7)
    assert torch.equal(select_topk(scores, valid, None, 1.0), valid)


def test_nan_scores_rank_last_and_never_pick_invalid():
    scores = torch.tensor([[float("nan"), 1.0, float("nan"), 0.5, 2.0]])
    valid = torch.tensor([[True, True, True, True, False]])
    keep = select_topk(scores, valid, None, 0.5)  # ceil(0.5 * 4) = 2
    assert keep.tolist() == [[False, True, False, True, False]]


def test_at_least_one_label_per_nonempty_row():
    scores = torch.randn(3, 50)
    valid = torch.zeros(3, 50, dtype=torch.bool)
    valid[1, 7] = True
    valid[2, :3] = True
    keep = select_topk(scores, valid, None, 0.01)
    assert keep.sum(1).tolist() == [0, 1, 1]


def test_ceil_is_exact_in_float64():
    # 0.1 * 10 in fp32 is 1.0000000149 (ceil 2); the count must equal Python's math.ceil(0.1 * 10) == 1.
    targets = torch.zeros(1, 10, dtype=torch.long)
    assert kept_per_row(targets, None, 0.1).tolist() == [math.ceil(0.1 * 10)]
    for n in range(1, 200):
        for ratio in (0.1, 0.3, 0.7, 1 / 3):
            assert kept_per_row(torch.zeros(1, n, dtype=torch.long), None, ratio).item() == math.ceil(ratio * n)


def test_count_stand_in_counts_kept_labels():
    scores, valid, groups = random_case(3, with_groups=True)
    targets = torch.where(valid, 5, -100)
    stand_in = count_stand_in(targets, groups, 0.3)
    assert stand_in.shape == targets.shape
    assert torch.equal(stand_in.ne(-100).sum(1), select_topk(scores, valid, groups, 0.3).sum(1))


def test_targets_are_a_shifted_view_or_shift_labels():
    labels = torch.arange(12).view(2, 6)
    view = targets_of({"labels": labels})
    view[0, 0] = -100
    assert labels[0, 1] == -100  # writes reach the batch's labels: score at t belongs to label t + 1
    shift = torch.ones(2, 6, dtype=torch.long)
    assert targets_of({"labels": labels, "shift_labels": shift}) is shift


def test_groups_start_at_position_zero():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert groups_of({"position_ids": position_ids}, 7).tolist() == [[1, 1, 1, 2, 2, 3, 3]]
    assert groups_of({}, 7) is None


def test_schedule():
    assert schedule_ratio(0, 0.25, 4, "constant") == 1.0
    assert schedule_ratio(3, 0.25, 4, "constant") == 1.0
    assert schedule_ratio(4, 0.25, 4, "constant") == 0.25
    assert schedule_ratio(0, 0.25, 4, "linear") == 1.0
    assert schedule_ratio(2, 0.25, 4, "linear") == pytest.approx(0.625)
    assert schedule_ratio(9, 0.25, 4, "linear") == 0.25
    assert schedule_ratio(0, 0.5, 0, "linear") == 0.5


def test_head_share_matches_hand_count():
    # Qwen2.5-0.5B shape: head 151936*896 vs 24 layers of (q,o 896^2 + k,v 2*896*128 + MLP 3*896*4864) -> 27.6%
    qwen = transformers.Qwen2Config(**shapes.config("qwen2.5-0.5b"))
    head = 151936 * 896
    body = 24 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864)
    assert head_share(qwen) == pytest.approx(head / (head + body), rel=1e-12)
    assert head_share(qwen) == pytest.approx(0.276, abs=0.001)
    smollm2 = transformers.LlamaConfig(**shapes.config("smollm2-135m"))
    assert head_share(smollm2) == pytest.approx(0.21, abs=0.005)
