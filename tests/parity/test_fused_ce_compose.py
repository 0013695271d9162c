"""The fused loss composed with the model-surgery optimizations, on a plain Trainer: OSFT's factored linears and
moe4bit's grouped 4-bit experts change the trunk, not the head, so each with the fused loss equals each alone (the
stock loss) within the fused loss's own fp32 bound (V·u, see test_fused_ce_sft.py). CGGR's composition is in
test_fused_ce_sft.py (its masked labels feed the fused loss)."""

from __future__ import annotations

import copy

import pytest
import torch

import leantrain
from leantrain import _compat
from leantrain.report import Status
from tests._fused_ce_trainers import UNIT_ROUNDOFF, VOCAB, assert_window_close, batches_of, greedy_rows, tiny, window
from tests._fused_ce_trainers import plain_trainer as make_trainer


FP32 = VOCAB * UNIT_ROUNDOFF[torch.float32]
OTHERS = {"cggr": False, "grpo_logps": False}


def compose(tmp_path, model, **opts):
    rows = greedy_rows()
    both = make_trainer(model, tmp_path / "both", rows)
    alone = make_trainer(copy.deepcopy(model), tmp_path / "alone", rows)
    # the fused loss requested (the tiny head is outside every measured cell), against the same patch without it
    report = leantrain.patch_trainer(both, fused_ce=True, **OTHERS, **opts)
    leantrain.patch_trainer(alone, fused_ce=False, **OTHERS, **opts)
    batches = batches_of(alone, 2)
    return report, window(both, batches), window(alone, batches)


def test_with_osft(tmp_path):
    report, ours, ref = compose(tmp_path, tiny(), osft=True, moe4bit=False)
    assert report["osft"].status is Status.APPLIED and report["fused_ce"].status is Status.APPLIED
    assert_window_close(ours, ref, FP32)


@pytest.mark.skipif(
    not _compat.at_least("transformers", _compat.TRANSFORMERS_3D_EXPERTS), reason="3-D expert stacks (transformers 5)"
)
def test_with_moe4bit(tmp_path):
    pytest.importorskip("bitsandbytes")
    model = tiny("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.02)
    model.set_experts_implementation("eager")
    leantrain.quantize_experts_4bit(model)
    report, ours, ref = compose(tmp_path, model, moe4bit=True, osft=False)
    assert report["moe4bit"].status is Status.APPLIED and report["fused_ce"].status is Status.APPLIED
    assert_window_close(ours, ref, FP32)
