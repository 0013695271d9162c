"""Grouped 4-bit MoE experts: op-level parity against the per-expert loop and HF eager experts, probe reasons,
chunking, recompute. CPU, seeded.

Shapes: every expert dimension here is a multiple of 64 (the blocksize) because bitsandbytes 0.50.2's native CPU
``dequantize_4bit`` is wrong for rows that are not a multiple of the blocksize (e.g. 32 columns at blocksize 64);
the per-expert reference loop would be wrong, not the grouped path (which dequantizes whole blocks).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from leantrain._compat import TRANSFORMERS_3D_EXPERTS, needs


_OLDER = needs("transformers", TRANSFORMERS_3D_EXPERTS, "Qwen3MoeExperts / GptOssExperts as 3-D experts")
if _OLDER:
    pytest.skip(_OLDER, allow_module_level=True)


bnb = pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as bnbf  # noqa: E402

from leantrain.moe4bit import _stacks, ops, quantize_experts_4bit, readiness  # noqa: E402
from leantrain.moe4bit import probe as moe_probe  # noqa: E402
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.moe4bit.registry import build_plan  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import linear4bit_experts_from  # noqa: E402
from tests._moe4bit_experts import HIDDEN, INTER, four_bit, stock_experts  # noqa: E402


T = 24
BF16_REL = 1e-2  # bf16: loop and grouped round differently (addmm vs mm+bias, bf16 vs fp32 combine); ~3e-3 seen


def dequantized_eager(layout: str, module: torch.nn.Module, stock: torch.nn.Module) -> torch.nn.Module:
    """HF's eager experts holding exactly the dequantized 4-bit weights, in the memory layout the 4-bit weights
    have (per-expert Linear4bit weights are [out, in]: gpt-oss's [E, in, out] parameter is then their transposed
    view, so BLAS sees the same operand layout as in the loop)."""
    ref = copy.deepcopy(stock)
    with torch.no_grad():
        for name, lists in (("gate_up_proj", "gate_up_projs"), ("down_proj", "down_projs")):
            if layout == "stacked":
                weight = getattr(module, name)  # bitsandbytes' parametrization dequantizes on access
            else:
                weight = torch.stack(
                    [bnbf.dequantize_4bit(lin.weight.data, lin.weight.quant_state) for lin in getattr(module, lists)]
                )
                weight = weight.transpose(1, 2) if stock.is_transposed else weight
            setattr(ref, name, torch.nn.Parameter(weight, requires_grad=False))
    return ref


def routing(num_experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """[T, k] expert ids where expert 0 gets no token and expert 1 exactly one (token 0)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, num_experts, generator=gen)
    scores[:, :2] = -1.0
    scores[0, 1] = 2.0
    return scores.topk(top_k, dim=1).indices


def run(fn, x0, logits0, idx, dense: bool, dtype, device: str = "cpu"):
    """Output, d(loss)/d(hidden) and d(loss)/d(router logits); routing weights are a softmax of the top logits."""
    # copy=True: in fp32 on CPU `.to` would return x0 itself and every run would accumulate into the same .grad
    x = x0.to(device, dtype, copy=True).requires_grad_()
    logits = logits0.to(device, dtype, copy=True).requires_grad_()
    idx = idx.to(device)
    weights = logits.gather(1, idx).softmax(-1)
    if dense:  # the community router's dense [T, E] scores
        weights = torch.zeros_like(logits).scatter(1, idx, weights)
    out = fn(x, idx, weights)
    probe = torch.linspace(-1, 1, out.numel(), device=device).view_as(out).to(dtype)
    (out * probe).sum().backward()
    return out.detach(), x.grad, logits.grad


def grouped(layout: str, module: torch.nn.Module, undo: Undo, recompute: bool = True):
    plan, check = build_plan(Found("experts", module, layout), undo.push, recompute)

    def fn(x, idx, w):
        check(x, idx, w)
        return ops.grouped_forward(plan, x, idx, w)

    return fn


def inputs(num_experts: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, HIDDEN, generator=gen), torch.randn(T, num_experts, generator=gen)


def assert_equal(a, b, what):
    assert torch.equal(a, b), f"{what}: max abs diff {(a.float() - b.float()).abs().max().item():.3g}"


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


CASES = [
    # (layout, family, nested, top_k, num_experts, dense)
    ("linear4bit", "gpt_oss", False, 2, 5, False),
    ("linear4bit", "gpt_oss", True, 2, 5, True),
    ("linear4bit", "qwen3_moe", True, 1, 5, False),
    ("linear4bit", "gpt_oss", True, 4, 6, True),
    ("stacked", "gpt_oss", False, 2, 5, False),
    ("stacked", "gpt_oss", True, 4, 6, False),
    ("stacked", "qwen3_moe", False, 1, 5, False),
    ("stacked", "qwen3_moe", True, 2, 6, False),
]


@pytest.mark.parametrize("layout,family,nested,top_k,num_experts,dense", CASES)
def test_fp32_bit_exact_vs_loop_and_hf_eager(layout, family, nested, top_k, num_experts, dense):
    """fp32: output, hidden-state grads and router grads are bit-identical to the stock per-expert loop and to HF's
    eager experts on the dequantized weights (zero-token and one-token experts included)."""
    stock = stock_experts(family, num_experts)
    module = four_bit(layout, stock, nested)
    eager = dequantized_eager(layout, module, stock)
    x0, logits0 = inputs(num_experts)
    idx = routing(num_experts, top_k)
    loop = run(module, x0, logits0, idx, dense, torch.float32)  # the stock path of this layout
    hf = run(eager, x0, logits0, idx, False, torch.float32)  # HF eager takes [T, k] weights
    undo = Undo()
    ours = run(grouped(layout, module, undo), x0, logits0, idx, dense, torch.float32)
    for name, a, b, c in zip(("output", "hidden grad", "router grad"), ours, loop, hf):
        assert_equal(a, b, f"{name} vs loop")
        assert_equal(a, c, f"{name} vs HF eager")
    assert_equal(run(module, x0, logits0, idx, dense, torch.float32)[0], loop[0], "loop after consolidation")
    undo()


@pytest.mark.parametrize("layout", ["linear4bit", "stacked"])
def test_single_token_bit_exact(layout):
    """A batch of one token (decode-like): every group but two is empty."""
    stock = stock_experts("gpt_oss", 6)
    module = four_bit(layout, stock, True)
    x0, logits0 = inputs(6)
    idx = torch.tensor([[4, 1]])
    loop = run(module, x0[:1], logits0[:1], idx, False, torch.float32)
    ours = run(grouped(layout, module, Undo()), x0[:1], logits0[:1], idx, False, torch.float32)
    for name, a, b in zip(("output", "hidden grad", "router grad"), ours, loop):
        assert_equal(a, b, name)


@pytest.mark.parametrize("layout,family,nested", [("linear4bit", "gpt_oss", True), ("stacked", "qwen3_moe", False)])
def test_bf16_close_to_loop(layout, family, nested):
    stock = stock_experts(family, 6, torch.bfloat16)
    module = four_bit(layout, stock, nested)
    x0, logits0 = inputs(6)
    idx = routing(6, 2)
    loop = run(module, x0, logits0, idx, False, torch.bfloat16)
    ours = run(grouped(layout, module, Undo()), x0, logits0, idx, False, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ours)
    for name, a, b in zip(("output", "hidden grad", "router grad"), ours, loop):
        assert rel_err(a, b) < BF16_REL, f"{name}: relative error {rel_err(a, b):.3g}"


@pytest.mark.parametrize("layout", ["linear4bit", "stacked"])
def test_recompute_on_off_equal(layout):
    """Saving the dequantized stacks or re-dequantizing them in backward gives identical results."""
    stock = stock_experts("gpt_oss", 5)
    x0, logits0 = inputs(5)
    idx = routing(5, 2)
    results = []
    for recompute in (True, False):
        module = four_bit(layout, stock, True)
        results.append(run(grouped(layout, module, Undo(), recompute), x0, logits0, idx, False, torch.float32))
    for name, a, b in zip(("output", "hidden grad", "router grad"), *results):
        assert_equal(a, b, name)


def test_recompute_saves_no_dequantized_stack():
    """With recompute the autograd graph holds no [E, rows, cols] tensor; without it, it holds both stacks."""
    stock = stock_experts("gpt_oss", 5)
    x0, logits0 = inputs(5)
    idx = routing(5, 2)
    for recompute, expected in ((True, 0), (False, 2)):
        module = four_bit("stacked", stock, False)
        fn = grouped("stacked", module, Undo(), recompute)
        x = x0.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(x, idx, logits0.gather(1, idx).softmax(-1))
        assert sum(t.dim() == 3 for t in saved) == expected


def test_activation_checkpointing_matches_and_counts_dequantizes():
    """Under (non-reentrant) activation checkpointing results equal the plain run; recompute dequantizes each stack
    once in forward and once in backward (plus once in the checkpoint re-forward)."""
    stock = stock_experts("gpt_oss", 5)
    x0, logits0 = inputs(5)
    idx = routing(5, 2)
    module = four_bit("linear4bit", stock, True)
    plan, _ = build_plan(Found("experts", module, "linear4bit"), Undo().push, recompute=True)
    calls = []
    for proj in (plan.gate_up, plan.down):
        proj.stack = copy.copy(proj.stack)
        proj.stack.dequantize = (lambda f: lambda dtype: calls.append(1) or f(dtype))(proj.stack.dequantize)

    def fn(x, i, w):
        return ops.grouped_forward(plan, x, i, w)

    plain = run(fn, x0, logits0, idx, False, torch.float32)
    assert len(calls) == 4  # forward + backward, two stacks
    calls.clear()

    def checkpointed(x, i, w):
        return torch.utils.checkpoint.checkpoint(fn, x, i, w, use_reentrant=False)

    ckpt = run(checkpointed, x0, logits0, idx, False, torch.float32)
    assert len(calls) == 6  # forward, re-forward and backward, two stacks
    for name, a, b in zip(("output", "hidden grad", "router grad"), ckpt, plain):
        assert_equal(a, b, name)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (aten op, output numel) of every op, except those run inside a dequantize."""

    def __init__(self):
        super().__init__()
        self.ops, self.in_dequantize = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.in_dequantize:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.ops.append((func.overloadpacket.__name__, first.numel() if isinstance(first, torch.Tensor) else 0))
        return out


@pytest.mark.parametrize("layout", ["linear4bit", "stacked"])
def test_recompute_costs_only_the_dequantize_and_backward_scatters_nothing(layout):
    """With recompute on, backward runs exactly the ops it runs with recompute off, plus one dequantize per stack
    (the gate is not re-run); neither backward scatters [T, H]-sized gradients (index_put_/index_add_)."""
    stock = stock_experts("gpt_oss", 5)
    x0, logits0 = inputs(5)
    idx = routing(5, 2)
    logs = {}
    for recompute in (True, False):
        module = four_bit(layout, stock, True)
        plan, _ = build_plan(Found("experts", module, layout), Undo().push, recompute=recompute)
        log, calls = _OpLog(), []
        for proj in (plan.gate_up, plan.down):
            proj.stack = copy.copy(proj.stack)

            def dequantize(dtype, f=proj.stack.dequantize):
                log.in_dequantize = True
                try:
                    calls.append(1)
                    return f(dtype)
                finally:
                    log.in_dequantize = False

            proj.stack.dequantize = dequantize
        x = x0.clone().requires_grad_()
        logits = logits0.clone().requires_grad_()
        out = ops.grouped_forward(plan, x, idx, logits.gather(1, idx).softmax(-1))
        n_forward = len(calls)
        with log:
            out.backward(torch.ones_like(out))
        logs[recompute] = (log.ops, len(calls) - n_forward)
    assert logs[True][1] == 2 and logs[False][1] == 0  # one dequantize per stack in backward, none without recompute
    assert logs[True][0] == logs[False][0]
    scatters = [op for op in logs[True][0] if op[0] in ("index_put_", "_index_put_impl_", "index_add_", "index_add")]
    assert all(n < T * HIDDEN for _, n in scatters), scatters


def test_dequantize_chunks_past_the_32bit_limit(monkeypatch):
    """Stacks past bitsandbytes' 32-bit element count are dequantized in chunks of experts; same bytes out."""
    stock = stock_experts("gpt_oss", 5)
    for nested in (False, True):
        module = four_bit("linear4bit", stock, nested)
        stack = _stacks.consolidate_linear4bit(list(module.gate_up_projs), Undo().push)
        whole = stack.dequantize(torch.float32)
        monkeypatch.setattr(_stacks, "MAX_ELEMENTS_PER_CALL", 2 * HIDDEN * 2 * INTER)  # two experts per call: 3 chunks
        assert_equal(stack.dequantize(torch.float32), whole, "chunked dequantize")
        monkeypatch.undo()
        per_expert = torch.stack(
            [bnbf.dequantize_4bit(lin.weight.data, lin.weight.quant_state) for lin in module.gate_up_projs]
        )
        assert_equal(whole, per_expert, "stacked vs per-expert dequantize")


def test_consolidation_shares_storage_and_undo_restores():
    """Patch time moves every expert's packed bytes and absmax into one buffer (views, no copies kept); undo gives
    each expert private tensors again with the same bytes."""
    module = four_bit("linear4bit", stock_experts("gpt_oss", 5), True)
    before = [(lin.weight.data.clone(), lin.weight.quant_state.absmax.clone()) for lin in module.gate_up_projs]
    undo = Undo()
    stack = _stacks.consolidate_linear4bit(list(module.gate_up_projs), undo.push)
    base = stack.data.untyped_storage().data_ptr()
    assert all(lin.weight.data.untyped_storage().data_ptr() == base for lin in module.gate_up_projs)
    undo()
    ptrs = {lin.weight.data.untyped_storage().data_ptr() for lin in module.gate_up_projs}
    assert len(ptrs) == len(module.gate_up_projs) and base not in ptrs
    for lin, (data, absmax) in zip(module.gate_up_projs, before):
        assert_equal(lin.weight.data, data, "packed bytes after undo")
        assert_equal(lin.weight.quant_state.absmax, absmax, "nested absmax after undo")


def test_routing_sorted_on_device():
    """Offsets come from one searchsorted (int32); pairs are sorted by expert, then slot, then token; each token's
    pairs are indexed in ascending (forward combine) and descending (input-gradient combine) expert order."""
    idx = routing(6, 2)
    r = ops.route(idx, 6)
    expected = torch.bincount(idx.flatten(), minlength=6).cumsum(0)
    assert r.offs.dtype == torch.int32 and torch.equal(r.offs.long(), expected)
    assert r.offs[0].item() == 0  # expert 0 got no token
    slot, tok = r.order // T, r.order % T
    assert torch.equal(r.eid, idx[tok, slot]) and torch.equal(r.tok, tok)
    key = r.eid * (2 * T) + slot * T + r.tok  # (expert, slot, token), strictly increasing
    assert bool((key[1:] > key[:-1]).all())
    ranked = r.eid[r.ascending].view(T, 2)  # each token's experts in ascending order
    assert bool((ranked[:, 1:] > ranked[:, :-1]).all())
    assert torch.equal(r.tok[r.ascending].view(T, 2), torch.arange(T)[:, None].expand(T, 2))
    assert torch.equal(r.descending.view(T, 2), r.ascending.view(T, 2).flip(1))


# ------------------------------------------------------------------------------------------------ probe reasons


def test_probe_not_applicable_without_moe_or_without_4bit():
    from leantrain.cli.tiny import tiny_model

    dense = readiness(tiny_model("llama", hidden=64, layers=1, vocab_size=128))
    assert not dense.applicable and "no MoE experts" in dense.reasons[0]
    moe = stock_experts("qwen3_moe", 5)
    not_4bit = readiness(moe)
    assert not not_4bit.applicable and "quantize_experts_4bit" in not_4bit.reasons[0]


def test_probe_ready_names_the_slow_path_on_cpu():
    result = readiness(four_bit("stacked", stock_experts("qwen3_moe", 5), False))
    assert result.ready and "slow path" in result.detail


def test_probe_bitsandbytes_missing(monkeypatch):
    module = four_bit("linear4bit", stock_experts("gpt_oss", 5), False)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes -> ImportError
    result = readiness(module)
    assert not result.ready and result.applicable
    assert result.reasons[0].startswith("bitsandbytes not installed")
    assert result.reasons[0].endswith(": pip install 'bitsandbytes>=0.50.2'")


def test_probe_lora_wrapped_experts():
    """LoRA on some experts only is declined (the grouped path serves LoRA on every expert alike:
    tests/parity/test_moe4bit_lora.py)."""
    peft = pytest.importorskip("peft")
    module = four_bit("linear4bit", stock_experts("gpt_oss", 5), False)
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["gate_up_projs.0", "down_projs.3"]), module)
    result = readiness(module)
    assert not result.ready and "LoRA adapters sit on some experts only" in result.reasons[0]


def test_probe_trainable_experts_and_cache_invalidation():
    module = four_bit("linear4bit", stock_experts("gpt_oss", 5), False)
    assert readiness(module).ready
    assert module in moe_probe._CACHE  # cached per module
    module.down_projs[2].bias.requires_grad_(True)
    result = readiness(module)
    assert not result.ready and "require grad" in result.reasons[0]
    stacked = four_bit("stacked", stock_experts("gpt_oss", 5), False)
    stacked.gate_up_proj_bias.requires_grad_(True)
    assert "biases require grad" in readiness(stacked).reasons[0]


def test_probe_mixed_formats_and_grouped_mm_unavailable(monkeypatch):
    stock = stock_experts("gpt_oss", 5)
    module = four_bit("linear4bit", stock, False)
    module.down_projs[4] = linear4bit_experts_from(stock, quant_type="fp4").down_projs[4]
    assert "differ in quant_type" in readiness(module).reasons[0]

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(moe_probe, "grouped_mm", broken)
    monkeypatch.setattr(moe_probe, "_GMM_CACHE", {})
    result = readiness(four_bit("stacked", stock, False))
    assert not result.ready and "grouped_mm does not run on cpu" in result.reasons[0]


def test_quantize_experts_4bit_reports_memory_and_freezes():
    module = stock_experts("gpt_oss", 5)
    for p in module.parameters():
        p.requires_grad_(True)
    report = quantize_experts_4bit(module)
    fp32_bytes = 4 * 5 * (HIDDEN * 2 * INTER + INTER * HIDDEN)
    assert report.bytes_before == fp32_bytes
    # 4 bits per weight plus one fp32 absmax per 64 weights
    assert report.bytes_after == fp32_bytes // 8 + fp32_bytes // 4 // 64 * 4
    assert "GiB" in str(report)
    assert not any(p.requires_grad for p in module.parameters())
    with pytest.raises(ValueError, match="no MoE experts"):
        quantize_experts_4bit(module)  # already quantized: nothing stock left
    with pytest.raises(ValueError, match="quant_type"):
        quantize_experts_4bit(stock_experts("gpt_oss", 5), quant_type="int4")
