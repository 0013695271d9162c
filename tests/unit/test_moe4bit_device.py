"""``quantize_experts_4bit`` models survive device moves, dtype changes and state-dict round trips; the moe4bit probe
and the per-call guard decline device mixes before any kernel runs. CPU (``meta`` stands in for a second device).

Regression tests for issue #10, defect 1: bitsandbytes' parametrization kept the quantization state out of
``module.to()``, so a model quantized on CPU and then moved to CUDA dequantized with host pointers (an illegal memory
access). Sizes: hidden 128 and expert intermediate 64, multiples of the 4-bit blocksize (bitsandbytes' CPU
dequantize is wrong for rows that are not).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch


pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbf  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model  # noqa: E402
from leantrain.moe4bit import readiness  # noqa: E402
from leantrain.moe4bit._qstate import FollowingParametrization  # noqa: E402
from leantrain.moe4bit._stacks import (
    STACK_NAMES,  # noqa: E402
    state_tensors,  # noqa: E402
)
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.moe4bit.registry import build_plan  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import convert_model_to_linear4bit_experts  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402


VOCAB = 256
FAMILIES = ("gpt_oss", "qwen3_moe")


def bf16_exact_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny fp32 model whose weights are all bf16-representable, so quantizing before or after a bf16 cast sees
    the same values (absmax and 4-bit codes are then identical, and so is every later op)."""
    model = tiny_model(family, seed=seed, hidden=128, layers=2, vocab_size=VOCAB)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.eval()


def quantized(family: str, seed: int = 0, **quant) -> torch.nn.Module:
    model = bf16_exact_model(family, seed)
    leantrain.quantize_experts_4bit(model, **quant)
    return model


def experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.experts for layer in model.model.layers]


def states(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of every stack's packed data and quantization state, by a readable name."""
    found = {}
    for i, experts in enumerate(experts_of(model)):
        for name in STACK_NAMES:
            plist = experts.parametrizations[name]
            found[f"{i}.{name}.packed"] = plist.original
            found.update({f"{i}.{name}.{k}": t for k, t in state_tensors(plist[0].quant_state).items()})
    return found


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(ids()).logits


@pytest.mark.parametrize("nested", [False, True])
def test_every_state_tensor_moves_with_the_module(nested):
    model = quantized("qwen3_moe", compress_statistics=nested)
    before = states(model)
    assert len(before) == 2 * 2 * (6 if nested else 3)  # layers x stacks x (packed, absmax, code[, 3 nested])
    assert all(t.device.type == "cpu" for t in before.values())
    model.to("meta")
    after = states(model)
    assert after.keys() == before.keys()
    for name, t in after.items():
        assert t.device.type == "meta", f"{name} stayed on {t.device}"
        assert (t.dtype, t.shape) == (before[name].dtype, before[name].shape), name


@pytest.mark.parametrize("nested", [False, True])
def test_dtype_change_keeps_the_bytes_and_retargets_the_dequantized_dtype(nested):
    """``.to(bf16)`` / ``.half()`` leave the uint8 codes and fp32 absmax bit for bit and make the stack dequantize
    to the new dtype (bitsandbytes rounds its fp32 dequantization once, so bf16 equals fp32 rounded); ``.float()``
    gives the original fp32 stack back exactly. A no-op conversion keeps every state tensor object."""
    model = quantized("gpt_oss", compress_statistics=nested)
    experts = experts_of(model)[0]
    before = {k: v.clone() for k, v in states(model).items()}
    identities = {k: id(v) for k, v in states(model).items()}
    fp32 = experts.gate_up_proj.clone()
    model.to("cpu").float()
    assert {k: id(v) for k, v in states(model).items()} == identities
    for dtype in (torch.bfloat16, torch.float16):
        model.to(dtype)
        for name, t in states(model).items():
            assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
        assert experts.gate_up_proj.dtype == dtype and experts.gate_up_proj_bias.dtype == dtype
        assert torch.equal(experts.gate_up_proj, fp32.to(dtype))
    model.float()
    assert torch.equal(experts.gate_up_proj, fp32)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantize_then_cast_equals_cast_then_quantize(family):
    """The stock forward of a model quantized in fp32 and then cast to bf16 equals (bitwise) that of a model cast
    first and quantized after, and computes in bf16 (the stacks dequantize to the model's dtype)."""
    before = quantized(family).to(torch.bfloat16)
    after = bf16_exact_model(family).to(torch.bfloat16)
    leantrain.quantize_experts_4bit(after)
    for name, t in states(after).items():
        assert torch.equal(states(before)[name], t), name
    assert experts_of(before)[0].down_proj.dtype == torch.bfloat16
    out = logits(before)
    assert out.dtype == torch.bfloat16 and torch.equal(out, logits(after))


@pytest.mark.parametrize("family,nested", [("gpt_oss", False), ("qwen3_moe", True)])
def test_state_dict_round_trip(family, nested, tmp_path):
    """state_dict -> (safetensors file) -> load_state_dict into a freshly quantized model of other weights: same
    packed data, quantization state and outputs; loading into a model cast to bf16 keeps its dtype."""
    source = quantized(family, seed=0, compress_statistics=nested)
    expected = logits(source)
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, tmp_path / "model.safetensors")
    target = quantized(family, seed=1, compress_statistics=nested)
    assert not torch.equal(logits(target), expected)
    target.load_state_dict(load_file(tmp_path / "model.safetensors"))
    for name, t in states(target).items():
        assert torch.equal(t, states(source)[name]), name
    assert torch.equal(logits(target), expected)
    cast = quantized(family, seed=1, compress_statistics=nested).to(torch.bfloat16)
    cast.load_state_dict(source.state_dict())
    assert experts_of(cast)[0].gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(logits(cast), logits(copy.deepcopy(source).to(torch.bfloat16)))


def test_save_pretrained_round_trip(tmp_path):
    """gpt-oss has no checkpoint conversion mapping: ``save_pretrained`` writes bitsandbytes' serialized stacks."""
    source = quantized("gpt_oss")
    source.save_pretrained(tmp_path)
    target = quantized("gpt_oss", seed=1)
    target.load_state_dict(load_file(tmp_path / "model.safetensors"))
    assert torch.equal(logits(target), logits(source))


def test_load_with_other_settings_is_a_clear_error():
    source = quantized("qwen3_moe", quant_type="fp4").state_dict()
    with pytest.raises(RuntimeError, match="quantize_experts_4bit with the settings of the checkpoint"):
        quantized("qwen3_moe").load_state_dict(source)
    stock = bf16_exact_model("qwen3_moe").state_dict()
    stock = {k.replace("parametrizations.", "").replace(".original", ""): v for k, v in stock.items()}
    with pytest.raises(RuntimeError, match="expected packed 4-bit data"):
        quantized("qwen3_moe").load_state_dict(stock)


def test_state_follows_packed_data_moved_without_module_to():
    """Per-tensor placement (accelerate, ``load_state_dict(assign=True)``) bypasses ``module.to``: the state follows
    the packed bytes at the next dequantize, before the kernel reads a pointer."""
    model = quantized("qwen3_moe")
    experts = experts_of(model)[0]
    plist = experts.parametrizations.gate_up_proj
    assert isinstance(plist[0], FollowingParametrization)
    plist._parameters["original"] = torch.nn.Parameter(
        plist.original.to("meta"), requires_grad=False
    )  # accelerate's way
    assert plist[0].quant_state.absmax.device.type == "cpu"
    assert experts.gate_up_proj.device.type == "meta"
    assert all(t.device.type == "meta" for t in state_tensors(plist[0].quant_state).values())


# ------------------------------------------------------------------------------------ probe and per-call guard


def linear4bit_model(family: str = "gpt_oss") -> torch.nn.Module:
    model = bf16_exact_model(family)
    convert_model_to_linear4bit_experts(model)
    return model


@pytest.mark.parametrize("where", ["absmax", "code", "bias"])
def test_probe_declines_a_stacked_device_mix(where):
    model = quantized("gpt_oss")
    assert readiness(model).ready
    experts = experts_of(model)[1]
    qs = experts.parametrizations.down_proj[0].quant_state
    if where == "bias":
        experts._parameters["down_proj_bias"] = torch.nn.Parameter(
            experts.down_proj_bias.to("meta"), requires_grad=False
        )
    else:
        setattr(qs, where, getattr(qs, where).to("meta"))
    result = readiness(model)
    assert not result.ready
    (reason,) = result.reasons
    assert "different devices" in reason and "on meta" in reason and "on cpu" in reason, reason
    assert ("down_proj_bias" if where == "bias" else f"down_proj {where}") in reason.split(" on meta")[0], reason
    assert "model.layers.1.mlp.experts" in reason


def test_probe_declines_a_linear4bit_device_mix():
    model = linear4bit_model()
    assert readiness(model).ready
    qs = experts_of(model)[0].gate_up_projs[3].weight.quant_state
    qs.absmax = qs.absmax.to("meta")
    (reason,) = readiness(model).reasons
    assert reason.startswith("4-bit expert tensors are on different devices (gate_up_projs.3 absmax on meta;"), reason


@pytest.mark.parametrize("layout", ["stacked", "linear4bit"])
def test_plan_guard_declines_moved_or_cast_modules_and_foreign_inputs(layout):
    """The per-call guard raises (-> run-time fallback) before any kernel when the module no longer holds the plan's
    tensors or the inputs are on another device; a no-op move keeps the plan."""
    model = quantized("gpt_oss") if layout == "stacked" else linear4bit_model()
    experts = experts_of(model)[0]
    plan, check = build_plan(Found("experts", experts, layout), Undo().push, recompute=True)
    x, idx, w = torch.randn(5, 128), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2)
    check(x, idx, w)
    model.to("cpu").float()  # no-op conversions
    check(x, idx, w)
    with pytest.raises(RuntimeError, match=r"inputs on meta / cpu / cpu, experts on cpu"):
        check(x.to("meta"), idx, w)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="moved, cast, reloaded or replaced after patching"):
        check(x, idx, w)


def test_plan_guard_declines_a_moved_stack():
    model = quantized("qwen3_moe")
    experts = experts_of(model)[0]
    _, check = build_plan(Found("experts", experts, "stacked"), Undo().push, recompute=True)
    model.to("meta")
    with pytest.raises(RuntimeError, match="packed expert stacks were moved"):
        check(*(t.to("meta") for t in (torch.randn(5, 128), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2))))


@pytest.mark.expect_fallback
def test_patched_model_cast_after_patching_falls_back_once(tmp_path):
    """Patched, then cast to bf16: one warning, then the stock path, whose outputs equal an unpatched model's."""
    import transformers

    model = quantized("qwen3_moe").train()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args)
    assert leantrain.patch_trainer(trainer, moe4bit=True, **others_off("moe4bit"))["moe4bit"].status.value == "applied"
    reference = quantized("qwen3_moe").train().to(torch.bfloat16)
    model.to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="moved, cast, reloaded or replaced after patching"):
        out = model(ids()).logits
    assert torch.equal(out, reference(ids()).logits)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(model(ids()).logits, out)  # stays on the stock path
    assert not [w for w in caught if "leantrain" in str(w.message)]
    assert leantrain.current_report(trainer)["moe4bit"].status.value == "failed"
    leantrain.unpatch_trainer(trainer)


def test_dequantize_matches_bitsandbytes_after_moves():
    """After a round trip through meta-free moves and casts, the grouped path's stack equals bitsandbytes' own
    dequantize of the same packed data."""
    model = quantized("gpt_oss", compress_statistics=True).to(torch.bfloat16).float()
    experts = experts_of(model)[0]
    plan, _ = build_plan(Found("experts", experts, "stacked"), Undo().push, recompute=True)
    plist = experts.parametrizations.gate_up_proj
    expected = bnbf.dequantize_4bit(plist.original, plist[0].quant_state)
    assert torch.equal(plan.gate_up.stack.dequantize(torch.float32), expected)
