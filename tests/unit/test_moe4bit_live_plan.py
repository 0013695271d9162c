"""moe4bit under FSDP2: the per-call plan (``layout_stacked.live_stacked_plan``) follows the tensors the module holds
at each call, as FSDP2 swaps whole stacks in around a layer's forward and backward, and it refuses, before any
kernel, what it cannot serve (a shard, a replaced quantization state, foreign-device inputs). The probe serves FSDP2
with stacked experts and declines FSDP1 and per-expert Linear4bit lists. CPU; the 2-process FSDP2 run is in
``tests/distributed/test_moe4bit_distributed.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


pytest.importorskip("bitsandbytes")

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model  # noqa: E402
from leantrain.moe4bit.layout_stacked import live_stacked_plan  # noqa: E402
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.moe4bit.ops import grouped_forward  # noqa: E402
from leantrain.moe4bit.probe import fsdp_reason  # noqa: E402
from leantrain.moe4bit.registry import build_plan  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import convert_model_to_linear4bit_experts  # noqa: E402


HIDDEN = 128  # a multiple of the 4-bit blocksize (bitsandbytes' CPU dequantize needs whole blocks per row)


def stacked_experts(family: str) -> torch.nn.Module:
    model = tiny_model(family, seed=0, hidden=HIDDEN, layers=1, vocab_size=256)
    leantrain.quantize_experts_4bit(model)
    return model.model.layers[0].mlp.experts


def inputs(experts: torch.nn.Module, tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    num = experts.num_experts
    x = torch.randn(tokens, HIDDEN, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(num, generator=g)[:2] for _ in range(tokens)])
    w = torch.rand(tokens, 2, generator=g).softmax(-1)
    return x, idx, w


def run(plan, x, idx, w) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    out = grouped_forward(plan, x, idx, w)
    out.square().sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])  # with and without biases
def test_live_plan_equals_the_fixed_plan(family):
    """Same tensors, same math: the per-call plan's outputs and input gradients equal the fixed plan's bitwise."""
    experts = stacked_experts(family)
    fixed, check = build_plan(Found("experts", experts, "stacked"), Undo().push, recompute=True)
    plan_for = live_stacked_plan(experts, recompute=True)
    x, idx, w = inputs(experts)
    check(x, idx, w)
    expected = run(fixed, x, idx, w)
    got = run(plan_for(x, idx, w), x, idx, w)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_live_plan_follows_a_swapped_in_stack():
    """FSDP2's unshard sets a new whole tensor on the module for each forward: the plan reads that one, not the
    tensor it saw at patch time."""
    experts = stacked_experts("gpt_oss")
    plan_for = live_stacked_plan(experts, recompute=True)
    x, idx, w = inputs(experts)
    before = run(plan_for(x, idx, w), x, idx, w)
    plist = experts.parametrizations.gate_up_proj
    swapped = torch.nn.Parameter(plist.original.detach().clone(), requires_grad=False)
    plist.original = swapped
    plan = plan_for(x, idx, w)
    assert plan.gate_up.stack.data.data_ptr() == swapped.data_ptr()
    after = run(plan, x, idx, w)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])


def test_live_plan_refuses_what_it_cannot_serve():
    experts = stacked_experts("gpt_oss")
    plan_for = live_stacked_plan(experts, recompute=True)
    x, idx, w = inputs(experts)
    with pytest.raises(RuntimeError, match="experts inputs on cpu / meta / cpu"):
        plan_for(x, idx.to("meta"), w)
    with pytest.raises(RuntimeError, match="quantization states are not on the inputs' device meta"):
        plan_for(*(t.to("meta") for t in (x, idx, w)))
    plist = experts.parametrizations.down_proj
    whole = plist.original
    plist.original = torch.nn.Parameter(whole.detach()[: whole.shape[0] // 2].clone(), requires_grad=False)  # a shard
    with pytest.raises(RuntimeError, match=r"down_proj: \d+ packed bytes on cpu .*the plan needs \d+, frozen"):
        plan_for(x, idx, w)
    plist.original = whole
    plist[0].quant_state = type(plist[0].quant_state)(absmax=plist[0].quant_state.absmax.clone())
    with pytest.raises(RuntimeError, match="quantization state of down_proj was replaced"):
        plan_for(x, idx, w)


def trainer(model: torch.nn.Module, fsdp_version: int | None) -> SimpleNamespace:
    plugin = SimpleNamespace(fsdp_version=fsdp_version)
    return SimpleNamespace(
        model=model,
        is_fsdp_enabled=fsdp_version is not None,
        accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)),
    )


def test_fsdp_reasons():
    stacked = tiny_model("gpt_oss", seed=0, hidden=HIDDEN, layers=1, vocab_size=256)
    leantrain.quantize_experts_4bit(stacked)
    lists = tiny_model("gpt_oss", seed=0, hidden=HIDDEN, layers=1, vocab_size=256)
    convert_model_to_linear4bit_experts(lists)
    assert fsdp_reason(trainer(stacked, None), stacked) is None
    assert fsdp_reason(trainer(stacked, 2), stacked) is None
    assert fsdp_reason(trainer(stacked, 1), stacked).startswith("FSDP1 flattens the packed 4-bit expert stacks")
    reason = fsdp_reason(trainer(lists, 2), lists)
    assert reason.startswith("FSDP2 would shard each expert's Linear4bit weight (model.layers.0.mlp.experts)"), reason
    assert fsdp_reason(trainer(lists, None), lists) is None
