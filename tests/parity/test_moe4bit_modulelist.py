"""Grouped 4-bit experts on transformers 4.x sparse MoE blocks (ModuleLists of per-expert MLPs loaded with
``BitsAndBytesConfig(load_in_4bit=True)``): the replaced block forward against the stock 4.57 block forward, and whole
tiny models through ``patch_trainer``. CPU, seeded.

The stock classes exist in transformers < 5 only (5.0 moved every family to 3-D experts): these tests run in the
4.57 floor venv (``.ci/matrix.sh``) and skip on 5.x. Sizes: hidden 128, expert intermediate 64, multiples of the 4-bit
blocksize 64 (bitsandbytes 0.50.2's CPU dequantize is wrong for last dims that are not, which breaks the stock loop).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tests._floor import floor_only


if _NEWER := floor_only("the per-expert ModuleList MoE blocks"):
    pytest.skip(_NEWER, allow_module_level=True)
pytest.importorskip("bitsandbytes")

import leantrain  # noqa: E402
from leantrain.moe4bit import (
    _adapters,  # noqa: E402
    readiness,  # noqa: E402
)
from leantrain.moe4bit import probe as moe_probe  # noqa: E402
from leantrain.moe4bit.layout_expert_mlps import NOT_4BIT_MLPS_REASON  # noqa: E402
from leantrain.moe4bit.layouts import Found  # noqa: E402
from leantrain.moe4bit.registry import find_experts  # noqa: E402
from leantrain.report import Status  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from testkit.moe4bit_models import load_in_4bit_like  # noqa: E402
from tests._moe4bit_modulelist import (  # noqa: E402
    ALL_FAMILIES,
    BF16_EPS,
    BLOCK_FAMILIES,
    DEEPSEEK_FP32,
    EXPERTS,
    FP32_EPS,
    FP32_GRAD_REL,
    HIDDEN,
    INTER,
    ONLY_MOE,
    SEQ,
    batch,
    block_of,
    config,
    make_trainer,
    patch_block,
    rel,
    tiny_4bit,
)


def run(block: torch.nn.Module, dtype: torch.dtype, seed: int = 1):
    """Output, router logits (None for DeepSeek-V2), input grad and router weight grad of one forward/backward;
    the loss weighs the output by a fixed ramp and adds the router logits' squares (an aux-loss stand-in)."""
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()
    out = block(x)
    hidden, logits = out if isinstance(out, tuple) else (out, None)
    loss = (hidden * torch.linspace(-1, 1, hidden.numel()).view_as(hidden).to(dtype)).sum()
    if logits is not None:
        loss = loss + 1e-3 * logits.float().pow(2).sum()
    loss.backward()
    router = block.gate.weight
    grad, router.grad = router.grad, None
    return hidden.detach(), None if logits is None else logits.detach(), x.grad, grad


def stock_and_ours(block: torch.nn.Module, dtype: torch.dtype):
    stock = run(block, dtype)
    undo = Undo()
    patch_block(block, undo)
    ours = run(block, dtype)
    undo()
    assert "forward" not in block.__dict__ and "moe" not in block.__dict__
    return stock, ours


NAMES = ("output", "router logits", "input grad", "router weight grad")


def gate_up_abs_terms(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per input element, the sum over its token's experts of |terms| of the gate/up input-grad dot products
    (``|dG| @ |W_gate| + |dU| @ |W_up|``), from a stock forward/backward with the same loss as :func:`run`."""
    import bitsandbytes.functional as bnbf

    grads: dict[int, list] = {}
    handles = []
    for e, expert in enumerate(block.experts):
        for slot, proj in enumerate(expert_projections_of(expert)[:2]):

            def keep(module, inputs, output, e=e, slot=slot):
                output.register_hook(lambda g: grads.setdefault(e, [None, None]).__setitem__(slot, g))

            handles.append(proj.register_forward_hook(keep))
    xg = x.detach().clone().requires_grad_()
    out = block(xg)
    hidden, logits = out
    (hidden * torch.linspace(-1, 1, hidden.numel()).view_as(hidden)).sum().add(1e-3 * logits.pow(2).sum()).backward()
    for h in handles:
        h.remove()
    block.gate.weight.grad = None
    flat = xg.view(-1, HIDDEN)
    weights = torch.softmax(logits.float(), dim=1)
    selected = torch.topk(weights, block.top_k, dim=-1).indices
    mask = torch.nn.functional.one_hot(selected, len(block.experts)).permute(2, 1, 0)
    total = torch.zeros_like(flat)
    for e, (dg, du) in grads.items():
        _, tokens = torch.where(mask[e])  # the stock loop's row order
        gate, up = expert_projections_of(block.experts[e])[:2]
        w = [bnbf.dequantize_4bit(p.weight.data, p.weight.quant_state).abs() for p in (gate, up)]
        total.index_add_(0, tokens, dg.abs() @ w[0] + du.abs() @ w[1])
    return total.view_as(x)


def expert_projections_of(expert: torch.nn.Module) -> tuple:
    names = ("gate_proj", "up_proj", "down_proj") if hasattr(expert, "gate_proj") else ("w1", "w3", "w2")
    return tuple(getattr(expert, n) for n in names)


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_fp32_block_matches_stock(family, top_k):
    """fp32: the same ops in the same order as the stock loop for the output, router logits and router weight grad
    (one gate_up GEMM per expert group computes each element as the separate gate/up GEMMs do; per-token sums in the
    loop's expert order): bit-identical. The input grad is the one reassociated sum: each pair's
    ``[dG dU] @ [W_gate; W_up]`` is one 2I-term dot product where the loop adds two I-term ones, so the two differ by
    at most 2I * eps * sum|terms| (two orders of an n-term sum: <= 2 * n * (eps / 2) * sum|terms| each way), with
    sum|terms| taken elementwise from the stock backward."""
    block = block_of(family, top_k=top_k)
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(1))
    abs_terms = gate_up_abs_terms(block, x)
    stock, ours = stock_and_ours(block, torch.float32)
    for name, a, b in zip(NAMES, ours, stock):
        if name == "input grad":
            excess = (a - b).abs() - 2 * INTER * FP32_EPS * abs_terms
            assert excess.max() <= 0, f"{name}: bound exceeded by {excess.max():.3g}"
            continue
        assert torch.equal(a, b), f"{name}: max abs diff {(a - b).abs().max():.3g}"


def test_fp32_deepseek_v2_within_gemm_reordering_bound():
    """DeepSeek-V2's stock ``moe`` groups tokens with an unstable ``argsort``, so rows sit at other positions of each
    expert's GEMM than on the grouped path (slot, then token order), and a row's dot products may be summed in another
    order. Two orders of an n-term dot product differ by <= n * eps * sum|terms|; the gate/up GEMM (n = H) feeds the
    down GEMM (n = I): <= (H + I) * eps * sum|terms|. sum|terms| is bounded by the result's scale times the
    cancellation ratio, taken as 4 * sqrt(H) (about 45; random-sign sums run near sqrt(n)). Routing is the stock
    router's own call."""
    stock, ours = stock_and_ours(block_of("deepseek_v2"), torch.float32)
    for name, a, b in zip(NAMES, ours, stock):
        if b is None:
            assert a is None
            continue
        bound = DEEPSEEK_FP32 * b.abs().max()
        assert (a - b).abs().max() <= bound, f"{name}: {(a - b).abs().max():.3g} > {bound:.3g}"


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_bf16_block_within_rounding_bounds(family):
    """bf16: the stock loop adds each expert's output (and each expert's input grad) into a bf16 buffer, rounding after
    every add (k adds), where the grouped path sums in fp32 and rounds once; the GEMMs accumulate in fp32 on both
    paths but may add in another order, flipping a bf16 rounding (one eps-relative step on an input of the next GEMM).
    Bound: (k + 2) roundings of eps * max|result| (k = 2 here) on every compared tensor."""
    stock, ours = stock_and_ours(block_of(family, torch.bfloat16), torch.bfloat16)
    for name, a, b in zip(NAMES, ours, stock):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype
        bound = (2 + 2) * BF16_EPS * b.float().abs().max()
        assert (a.float() - b.float()).abs().max() <= bound, f"{name}: {(a.float() - b.float()).abs().max():.3g}"


def test_recompute_off_equals_on_and_router_in_4bit():
    """Saving the dequantized stacks for backward gives the same bits as re-dequantizing; a 4-bit router (what
    BitsAndBytesConfig makes of ``gate`` by default) is called as the stock module: output and logits stay exact."""
    block = block_of("qwen2_moe")
    load_in_4bit_like(block)  # the router (and the shared expert gate) too: BitsAndBytesConfig's default
    block.gate.weight.grad = None
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(3))
    results = []
    for recompute in (None, True, False):
        undo = Undo()
        if recompute is not None:
            patch_block(block, undo, recompute)
        xi = x.clone().requires_grad_()
        out, logits = block(xi)
        (out.pow(2).sum() + logits.pow(2).sum()).backward()
        results.append((out.detach(), logits.detach(), xi.grad))
        undo()
    for name, a, b in zip(("output", "router logits", "input grad"), results[1], results[2]):
        assert torch.equal(a, b), f"recompute on vs off: {name}"
    for name, a, b in zip(("output", "router logits"), results[1], results[0]):
        assert torch.equal(a, b), f"vs stock: {name}"  # (the input grad: see test_fp32_block_matches_stock)


def test_consolidation_keeps_state_dict_and_undo_restores():
    """Patch time re-homes every expert's packed bytes into two stacks (views); the state dict hands out private
    copies with the same bytes, and undo gives each expert private storage again."""
    block = block_of("mixtral")
    before = {k: v.clone() for k, v in block.state_dict().items()}
    undo = Undo()
    patch_block(block, undo)
    w1 = [e.w1.weight for e in block.experts]
    assert len({w.data.untyped_storage().data_ptr() for w in w1}) == 1  # one gate_up buffer
    state = block.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], v) for k, v in before.items())
    expert_keys = [k for k in state if k.startswith("experts.") and k.endswith(".weight")]
    assert len({state[k].untyped_storage().data_ptr() for k in expert_keys}) == len(expert_keys)
    undo()
    assert len({w.data.untyped_storage().data_ptr() for w in w1}) == len(w1)
    assert all(torch.equal(block.state_dict()[k], v) for k, v in before.items())


# ----------------------------------------------------------------------------------------------------- declines


def reason_of(block: torch.nn.Module) -> str | None:
    return moe_probe.module_reason(Found("mlp", block, "expert_mlps"), _adapters.wrapped_map(block))


def test_declines_jitter_noise():
    reason = reason_of(block_of("mixtral", router_jitter_noise=0.1))
    assert reason.startswith("router jitter noise (0.1)") and "router_jitter_noise=0" in reason


def test_declines_lora_on_some_experts_only():
    """LoRA on every expert projection is served (tests/parity/test_moe4bit_lora4x.py); on one expert only it is
    declined with its reason."""
    peft = pytest.importorskip("peft")
    block = block_of("qwen3_moe")
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["experts.2.up_proj"]), block)
    assert reason_of(block).startswith("LoRA adapters sit on some experts only (up_proj: 1 of 6)")


def test_declines_mixed_formats_biases_and_foreign_forwards():
    block = block_of("olmoe")
    fp4, nf4 = block.experts[0].down_proj, block_of("qwen2_moe").experts[0].down_proj
    block.experts[0].down_proj = nf4  # olmoe's experts are fp4 here
    assert "differ in quant_type" in reason_of(block)
    block.experts[0].down_proj = fp4
    assert reason_of(block) is None

    biased = block_of("deepseek_v2", mlp_bias=True)
    assert reason_of(biased).startswith("expert projections have biases")

    class Custom(type(block)):  # a subclass with its own routing: not reproduced
        def forward(self, hidden_states):
            return super().forward(hidden_states)

    block.__class__ = Custom
    assert "is not a stock transformers 4.x MoE block forward" in reason_of(block)
    block.__class__ = Custom.__mro__[1]
    block.forward = lambda hidden_states: hidden_states  # another library's instance patch
    assert "already replaced on the instance" in reason_of(block)


def test_not_4bit_and_version_reasons():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("qwen3_moe"))
    ready = readiness(model)
    assert not ready.applicable and ready.reasons[0] == NOT_4BIT_MLPS_REASON
    assert [f.layout for f in find_experts(model)] == ["expert_mlps"] * 2
    load_in_4bit_like(model)
    assert readiness(model).ready  # transformers 4.57: the per-expert MLP blocks are served


# ------------------------------------------------------------------------------------------- whole tiny models


def step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (aux loss included: output_router_logits) and the trainable parameters' grads of one step."""
    loss = model(**batch()).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_training_step_matches_stock(family, tmp_path):
    """fp32, aux loss on, through ``patch_trainer`` with a plain Trainer: the loss and the last layer's router grad
    (no block input grad on its path) are bit-identical to the stock model (DeepSeek-V2: within its GEMM reordering
    bound); the other trainable grads (embeddings, norms, the first router) within FP32_GRAD_REL. No adapters."""
    stock_loss, stock_grads = step(tiny_4bit(family))
    model = tiny_4bit(family)
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
    assert report["moe4bit"].status is Status.APPLIED and len(report["moe4bit"].targets) == 2
    assert "expert_mlps" in report["moe4bit"].detail
    loss, grads = step(model)
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED  # no silent fallback
    assert grads.keys() == stock_grads.keys() and not any("lora" in n for n in grads)
    last_router = [n for n in grads if ".gate." in n][-1]
    if family == "deepseek_v2":
        bound = DEEPSEEK_FP32
        assert (
            abs(loss - stock_loss) <= bound * stock_loss and rel(grads[last_router], stock_grads[last_router]) <= bound
        )
    else:
        assert torch.equal(loss, stock_loss), (loss, stock_loss)
        assert torch.equal(grads[last_router], stock_grads[last_router])
    for name, grad in grads.items():
        assert rel(grad, stock_grads[name]) <= FP32_GRAD_REL, f"{name}: {rel(grad, stock_grads[name]):.3g}"
    leantrain.unpatch_trainer(trainer)


def test_trainer_train_runs_patched(tmp_path):
    """``trainer.train()`` on the patched model: the grouped path serves every step (no fallback), losses finite and
    within the gradient bound's reach of the stock run's."""
    losses = []
    for patch in (False, True):
        trainer = make_trainer(tiny_4bit("qwen2_moe"), tmp_path / str(patch), steps=3)
        if patch:
            leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
        trainer.train()
        if patch:
            assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED
            leantrain.unpatch_trainer(trainer)
        losses.append([log["loss"] for log in trainer.state.log_history if "loss" in log])
    assert len(losses[1]) == 3 and all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(*losses)), losses


@pytest.mark.expect_fallback
def test_runtime_fallback_and_unpatch_identity(tmp_path, monkeypatch):
    """An error inside the grouped path warns once and serves the stock forward (same loss); unpatch restores the
    original forwards by identity."""
    from leantrain.moe4bit import _custom_ops

    stock = tiny_4bit("qwen2_moe")
    batch = {"input_ids": torch.arange(3, 3 + SEQ).view(1, -1), "labels": torch.arange(3, 3 + SEQ).view(1, -1)}
    stock_loss = stock(**batch).loss
    model = copy.deepcopy(tiny_4bit("qwen2_moe"))
    blocks = [layer.mlp for layer in model.model.layers]
    trainer = make_trainer(model, tmp_path)
    leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
    assert all("forward" in b.__dict__ for b in blocks)

    def broken(*args, **kwargs):
        raise RuntimeError("injected grouped_mm failure")

    monkeypatch.setattr(_custom_ops, "grouped_mm", broken)
    with pytest.warns(RuntimeWarning, match="moe4bit failed at run time"):
        loss = model(**batch).loss
    assert torch.equal(loss, stock_loss)
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.FAILED
    leantrain.unpatch_trainer(trainer)
    assert all("forward" not in b.__dict__ for b in blocks)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_block4x_mirror_equals_the_stock_block(family):
    """testkit.moe4bit_models.SparseMoeBlock4x (the 4.x block for GPU tests and benchmarks on transformers 5.x)
    computes what the 4.57 class computes, bit for bit, from the same weights (same state-dict keys), quantized the
    same way."""
    from testkit.moe4bit_models import SparseMoeBlock4x

    cfg = config(family)
    torch.manual_seed(0)
    stock = find_experts(transformers.AutoModelForCausalLM.from_config(cfg))[0].module
    for p in stock.parameters():
        torch.nn.init.normal_(p, std=0.05)
    shared = INTER if family == "qwen2_moe" else 0
    mirror = SparseMoeBlock4x(HIDDEN, INTER, EXPERTS, cfg.num_experts_per_tok, cfg.norm_topk_prob, shared)
    mirror.load_state_dict(stock.state_dict())  # strict: the same keys
    for b in (stock, mirror):
        load_in_4bit_like(b, skip=("gate",))
    for name, a, b in zip(NAMES, run(mirror.train(), torch.float32), run(stock.train(), torch.float32)):
        assert torch.equal(a, b), name


def test_qlora_on_attention_and_all_linear_served(tmp_path):
    """QLoRA as users set it up: LoRA on the attention projections leaves the expert Linear4bit modules plain (served;
    the loss equals the stock PEFT model's, the adapters get the same grads); ``target_modules="all-linear"`` wraps
    every expert projection (and the routers): served too (tests/parity/test_moe4bit_lora4x.py has the parity)."""
    peft = pytest.importorskip("peft")

    def lora_model(targets):
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        torch.manual_seed(1)
        return peft.get_peft_model(tiny_4bit("qwen3_moe"), cfg)

    stock_loss, stock_grads = step(lora_model(["q_proj", "v_proj"]))
    model = lora_model(["q_proj", "v_proj"])
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
    assert report["moe4bit"].status is Status.APPLIED
    loss, grads = step(model)
    assert torch.equal(loss, stock_loss)
    assert any("lora_A" in n for n in grads)
    for name, grad in grads.items():
        assert rel(grad, stock_grads[name]) <= FP32_GRAD_REL, name
    leantrain.unpatch_trainer(trainer)

    stock_loss = lora_model("all-linear")(**batch()).loss
    model = lora_model("all-linear")
    wrapped = make_trainer(model, tmp_path / "all")
    report = leantrain.patch_trainer(wrapped, moe4bit=True, **ONLY_MOE)  # auto: not measured faster on this shape
    assert report["moe4bit"].status is Status.APPLIED, report["moe4bit"].reasons
    assert torch.equal(model(**batch()).loss, stock_loss)
    leantrain.unpatch_trainer(wrapped)


def test_probe_serves_blocks_after_transformers_output_recording():
    """transformers 4.57 records router logits by binding each block's forward on the instance around a call and
    leaves the class's own method there: that is not another library's patch, the block is still served."""
    model = tiny_4bit("qwen3_moe")
    model(**batch())
    block = model.model.layers[0].mlp
    assert "forward" in block.__dict__ and block.__dict__["forward"].__func__ is type(block).forward
    assert reason_of(block) is None
