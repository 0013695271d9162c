"""PEFT LoRA on the experts of transformers 4.x sparse MoE blocks (each expert an MLP of per-expert ``Linear4bit``
projections, ``BitsAndBytesConfig(load_in_4bit=True)``) through the grouped path, against PEFT's per-expert loop
(the same model unpatched): block outputs, router logits and gradients, the input gradient, every ``lora_A`` /
``lora_B`` gradient; whole training steps per family through ``patch_trainer``; dropout, rslora, several adapters,
``disable_adapter()``, save/reload through PEFT, decline reasons and the run-time fallback. CPU, seeded.

The stock blocks exist in transformers < 5 only: these tests run in the 4.57 floor venv (``.ci/matrix.sh``) and skip
on 5.x (tests/parity/test_moe4bit_block4x.py runs the same block math there on a test-local copy of the 4.57 block).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._floor import floor_only


if _NEWER := floor_only("the per-expert ModuleList MoE blocks"):
    pytest.skip(_NEWER, allow_module_level=True)
pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

import leantrain  # noqa: E402
from leantrain.moe4bit.layouts import expert_mlp_names, expert_projections  # noqa: E402
from leantrain.report import Status  # noqa: E402
from leantrain.undo import Undo  # noqa: E402
from tests._moe4bit_modulelist import (  # noqa: E402
    ALL_FAMILIES,
    BF16_EPS,
    BLOCK_FAMILIES,
    DEEPSEEK_FP32,
    FP32_EPS,
    FP32_GRAD_REL,
    INTER,
    ONLY_MOE,
    batch,
    block_of,
    make_trainer,
    patch_block,
    rel,
    tiny_4bit,
)


RANK = 8
# Norm-wise bound on the block's input gradient: each pair's gate/up input gradient is one 2I-term dot product on the
# grouped path where the loop adds two I-term ones (<= 2I * eps * sum|terms| elementwise; sum|terms| of random-sign
# data runs about sqrt(2I) times the result), and the adapters' input gradients join the sum in another order (a few
# adds more: 2r + 4 terms).
INPUT_GRAD_REL = (2 * INTER + 2 * RANK + 4) * FP32_EPS * (2 * INTER) ** 0.5


def expert_targets(block: torch.nn.Module) -> list[str]:
    """The expert projection names of the family (Mixtral: w1/w3/w2), as a user lists them in target_modules."""
    return list(expert_mlp_names(block.experts[0]))


def lora_block(family: str, dtype: torch.dtype = torch.float32, **lora) -> torch.nn.Module:
    """One stock 4.57 block in 4-bit with seeded LoRA (random B, so the adapters contribute) on every expert
    projection (the shared expert's too, which stays a stock call); the router trains, so its gradient is compared."""
    block = block_of(family, dtype)
    cfg = dict(r=RANK, lora_alpha=2 * RANK, target_modules=expert_targets(block), init_lora_weights=False) | lora
    torch.manual_seed(1)
    peft.inject_adapter_in_model(peft.LoraConfig(**cfg), block)
    block.gate.weight.requires_grad_(True)
    down = expert_projections(block)[2][0]
    assert type(down).__name__ == "Linear4bit" and hasattr(down, "lora_A")  # PEFT's lora.Linear4bit
    return block.train()


def run(block: torch.nn.Module, dtype: torch.dtype = torch.float32):
    """(output, router logits or None, input grad, {name: grad} of the router and every adapter) of one step."""
    x = torch.randn(2, 12, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    x = x.to(dtype).requires_grad_()
    out = block(x)
    hidden, logits = out if isinstance(out, tuple) else (out, None)
    loss = (hidden * torch.linspace(-1, 1, hidden.numel()).view_as(hidden).to(dtype)).sum()
    if logits is not None:
        loss = loss + 1e-3 * logits.float().pow(2).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    return hidden.detach(), None if logits is None else logits.detach(), x.grad, grads


def stock_and_ours(block: torch.nn.Module, dtype: torch.dtype = torch.float32):
    stock = run(block, dtype)
    undo = Undo()
    patch_block(block, undo)
    ours = run(block, dtype)
    undo()
    assert "forward" not in block.__dict__ and "moe" not in block.__dict__
    return stock, ours


def within(ours: torch.Tensor, ref: torch.Tensor, terms: int, eps: float) -> tuple[bool, float, float]:
    """|ours - ref| <= terms * eps * max|ref|: two summation orders of at most ``terms`` products."""
    scale = ref.float().abs().max().item()
    err = (ours.float() - ref.float()).abs().max().item()
    return err <= terms * eps * scale, err, scale


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_fp32_block_lora_matches_peft_loop(family):
    """fp32: the base and the adapters' GEMMs are the loop's per-expert matmuls on the same rows (grouped_mm on CPU
    runs one mm per group), so the output, router logits and router gradient are bit-identical. Adapter gradients
    are per-expert weight-gradient GEMMs over the expert's rows in the other operand order (A^T B vs (B^T A)^T): at
    most one reordering of the 24 token rows' sum each. The input gradient: INPUT_GRAD_REL (norm-wise)."""
    block = lora_block(family)
    stock, ours = stock_and_ours(block)
    for name, a, b in zip(("output", "router logits"), ours[:2], stock[:2]):
        assert torch.equal(a, b), f"{name}: {(a - b).abs().max():.3g}"
    assert rel(ours[2], stock[2]) <= INPUT_GRAD_REL, rel(ours[2], stock[2])
    grads, ref = ours[3], stock[3]
    assert grads.keys() == ref.keys()
    lora = [n for n in grads if "lora_" in n and n.startswith("experts.")]
    assert len(lora) == 2 * 3 * len(block.experts)  # every expert's A and B on gate, up and down
    assert torch.equal(grads["gate.weight"], ref["gate.weight"])
    for name in grads:
        ok, err, scale = within(grads[name], ref[name], 24, FP32_EPS)
        assert ok, f"{name}: {err:.3g} vs scale {scale:.3g}"


def test_fp32_deepseek_v2_lora_within_gemm_reordering_bound():
    """DeepSeek-V2's stock ``moe`` orders rows by an unstable argsort (see test_moe4bit_modulelist): every compared
    quantity within the GEMM-reordering bound DEEPSEEK_FP32 of its scale."""
    stock, ours = stock_and_ours(lora_block("deepseek_v2"))
    for name, a, b in zip(("output", "input grad"), (ours[0], ours[2]), (stock[0], stock[2])):
        assert (a - b).abs().max() <= DEEPSEEK_FP32 * b.abs().max(), name
    assert ours[3].keys() == stock[3].keys() and any("lora_B" in n for n in ours[3])
    for name, grad in ours[3].items():
        assert (grad - stock[3][name]).abs().max() <= DEEPSEEK_FP32 * stock[3][name].abs().max(), name


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_bf16_block_lora_within_rounding_bounds(family):
    """bf16: PEFT's adapter rounds x·A, the output, the scaled output and the sum with the base, as the split path
    does; the base path rounds as in test_moe4bit_modulelist's bf16 test ((k + 2) roundings, k = 2). The adapters'
    gradients sum their 24 rows in the GEMM's fp32 accumulator on both paths, from bf16 inputs that may differ by one
    rounding: (k + 2) roundings of their scale too."""
    stock, ours = stock_and_ours(lora_block(family, torch.bfloat16), torch.bfloat16)
    bound = 2 + 2
    for name, a, b in zip(("output", "router logits", "input grad"), ours[:3], stock[:3]):
        assert a.dtype == b.dtype
        assert within(a, b, bound, BF16_EPS)[0], f"{name}: {within(a, b, bound, BF16_EPS)[1:]}"
    for name, grad in ours[3].items():
        ok, err, scale = within(grad, stock[3][name], bound, BF16_EPS)
        assert ok, f"{name}: {err:.3g} vs scale {scale:.3g}"


def test_gate_up_with_different_adapters_and_scalings():
    """gate, up and down may carry different adapters (an adapter on the up projection only) and scalings (rslora,
    alpha_pattern): each adds to its own half of the gate_up output; the others add zeros there."""
    block = block_of("qwen3_moe")
    first = peft.LoraConfig(
        r=RANK, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False,
        alpha_pattern={"up_proj": 4}, use_rslora=True,
    )  # fmt: skip
    second = peft.LoraConfig(r=16, lora_alpha=8, target_modules=["up_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    peft.inject_adapter_in_model(first, block)
    peft.inject_adapter_in_model(second, block, adapter_name="second")
    for module in block.modules():
        if hasattr(module, "set_adapter"):
            module.set_adapter(["default", "second"])
    block.gate.weight.requires_grad_(True)
    stock, ours = stock_and_ours(block.train())
    assert torch.equal(ours[0], stock[0])
    assert any("lora_A.second" in n for n in ours[3])
    for name, grad in ours[3].items():
        assert within(grad, stock[3][name], 24, FP32_EPS)[0], name


# ------------------------------------------------------------------------------------------------ whole models


def lora_model(family: str, targets, **lora) -> torch.nn.Module:
    """A whole tiny 4-bit model with PEFT LoRA (seeded, random B); the routers train (their grads are compared)."""
    cfg = dict(r=RANK, lora_alpha=2 * RANK, target_modules=targets, init_lora_weights=False) | lora
    torch.manual_seed(1)
    model = peft.get_peft_model(tiny_4bit(family), peft.LoraConfig(**cfg))
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
            param.requires_grad_(True)
    return model


def grads_step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch()).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def patched(model, tmp_path):
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
    assert report["moe4bit"].status is Status.APPLIED, report["moe4bit"].reasons
    assert "expert LoRA as split grouped GEMMs on 2 modules" in report["moe4bit"].detail
    return trainer


TARGETS = {  # attention and every expert projection, as users write them (or "all-linear": the routers too)
    "qwen2_moe": "all-linear",
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mixtral": ["q_proj", "v_proj", "w1", "w2", "w3"],
    "olmoe": "all-linear",
    "deepseek_v2": "all-linear",
}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_training_step_matches_peft(family, tmp_path):
    """fp32, aux loss on: the loss equals PEFT's per-expert model bit for bit (DeepSeek-V2: within its reordering
    bound); every trainable gradient (every expert's A and B, attention adapters, routers) within FP32_GRAD_REL
    (the reassociated block input gradient carried back through the layers, test_moe4bit_modulelist)."""
    stock_loss, stock_grads = grads_step(lora_model(family, TARGETS[family]))
    model = lora_model(family, TARGETS[family])
    trainer = patched(model, tmp_path)
    loss, grads = grads_step(model)
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED  # no silent fallback
    assert grads.keys() == stock_grads.keys()
    assert sum(".experts." in n and "lora_A" in n for n in grads) >= 3 * 6  # 6 experts x gate/up/down, per layer
    if family == "deepseek_v2":
        assert abs(loss - stock_loss) <= DEEPSEEK_FP32 * stock_loss
    else:
        assert torch.equal(loss, stock_loss), (loss, stock_loss)
    for name, grad in grads.items():
        assert rel(grad, stock_grads[name]) <= FP32_GRAD_REL, f"{name}: {rel(grad, stock_grads[name]):.3g}"
    leantrain.unpatch_trainer(trainer)


def test_optimizer_steps_are_seen_and_trainer_losses_match(tmp_path):
    """``trainer.train()`` (AdamW) on the patched model logs the per-step losses of the stock PEFT run: each optimizer
    step on the adapters is seen by the next forward."""
    losses = []
    for patch in (False, True):
        model = lora_model("qwen3_moe", TARGETS["qwen3_moe"])
        trainer = make_trainer(model, tmp_path / str(patch), steps=3)
        if patch:
            leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
        trainer.train()
        if patch:
            assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED
            leantrain.unpatch_trainer(trainer)
        losses.append([log["loss"] for log in trainer.state.log_history if "loss" in log])
    assert len(losses[1]) == 3 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(*losses)), losses


def test_disabled_and_several_adapters(tmp_path):
    """``disable_adapter()`` serves the grouped base alone (bit-exact: the stock loop's base); a second adapter
    (rslora) alone and both adapters active match PEFT's loop."""
    stock, model = (lora_model("qwen2_moe", TARGETS["qwen3_moe"]) for _ in range(2))
    second = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"])
    for m in (stock, model):
        torch.manual_seed(2)
        m.add_adapter("second", second)
        with torch.no_grad():
            for name, param in m.named_parameters():
                if "lora_B.second" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    trainer = patched(model, tmp_path)
    with model.disable_adapter(), stock.disable_adapter():
        assert torch.equal(model(**batch()).loss, stock(**batch()).loss)
    for active in (["second"], ["default", "second"]):
        for m in (stock, model):
            m.base_model.set_adapter(active)
        loss, ref = model(**batch()).loss, stock(**batch()).loss
        assert torch.equal(loss, ref), (active, loss, ref)
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED
    leantrain.unpatch_trainer(trainer)


def test_dropout(tmp_path):
    """Dropout p > 0: off in eval (then equal to PEFT's loop), on in training (reproducible under a seed; a mask per
    adapter layer, drawn per call over all rows)."""
    stock = lora_model("olmoe", TARGETS["olmoe"], lora_dropout=0.5)
    model = copy.deepcopy(stock)
    trainer = patched(model, tmp_path)
    model.eval(), stock.eval()
    assert torch.equal(model(**batch()).loss, stock(**batch()).loss)
    model.train()
    torch.manual_seed(0)
    first = model(**batch()).loss.detach()
    torch.manual_seed(0)
    assert torch.equal(model(**batch()).loss.detach(), first)
    assert not torch.equal(first, model.eval()(**batch()).loss.detach())
    leantrain.unpatch_trainer(trainer)


def test_save_pretrained_and_reload(tmp_path):
    """Adapters save through PEFT's ``save_pretrained`` unchanged (same keys and values as the unpatched model) and
    a fresh model loads them with ``PeftModel.from_pretrained``: the same loss, patched."""
    from safetensors.torch import load_file

    model = lora_model("mixtral", TARGETS["mixtral"])
    unpatched = copy.deepcopy(model)
    trainer = patched(model, tmp_path / "a")
    expected = model(**batch()).loss.detach()
    model.save_pretrained(tmp_path / "patched")
    unpatched.save_pretrained(tmp_path / "stock")
    saved, ref = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("patched", "stock"))
    assert saved.keys() == ref.keys() and all(torch.equal(saved[k], ref[k]) for k in ref)
    leantrain.unpatch_trainer(trainer)
    reloaded = peft.PeftModel.from_pretrained(tiny_4bit("mixtral"), tmp_path / "patched", is_trainable=True)
    trainer = patched(reloaded, tmp_path / "b")
    assert torch.equal(reloaded(**batch()).loss.detach(), expected)
    leantrain.unpatch_trainer(trainer)


@pytest.mark.parametrize(
    "targets,lora,reason",
    [
        (None, {"use_dora": True}, "DoRA"),
        (None, {"lora_bias": True}, "LoRA bias"),
        (None, {"rank_pattern": {"experts.2.up_proj": 4}}, "differ in their LoRA adapters"),
        (["experts.1.gate_proj", "experts.3.down_proj"], {}, "some experts only"),
    ],
)
def test_declines_with_reason(targets, lora, reason, tmp_path):
    model = lora_model("qwen3_moe", targets or TARGETS["qwen3_moe"], **lora)
    report = leantrain.patch_trainer(make_trainer(model, tmp_path), **ONLY_MOE)
    assert report["moe4bit"].status is Status.SKIPPED and reason in report["moe4bit"].reasons[0]


def test_other_tuners_decline(tmp_path):
    torch.manual_seed(1)
    model = peft.get_peft_model(tiny_4bit("qwen3_moe"), peft.LoHaConfig(r=4, target_modules=["up_proj", "down_proj"]))
    report = leantrain.patch_trainer(make_trainer(model, tmp_path), **ONLY_MOE)
    assert report["moe4bit"].status is Status.SKIPPED and "LoRA only" in report["moe4bit"].reasons[0]


@pytest.mark.expect_fallback
def test_forward_hooks_and_injected_errors_fall_back(tmp_path, monkeypatch):
    """PEFT's mixed-adapter batches (per-layer forward hooks) and an error inside the grouped path fall back to the
    stock per-expert loop (warned once), with its result."""
    from leantrain.moe4bit import lora as lora_math

    stock = lora_model("qwen3_moe", TARGETS["qwen3_moe"])
    model = copy.deepcopy(stock)
    trainer = patched(model, tmp_path)
    expert = model.base_model.model.model.layers[0].mlp.experts[0].up_proj
    handle = expert.register_forward_pre_hook(lambda m, a: None)
    with pytest.warns(RuntimeWarning, match="moe4bit failed at run time"):
        loss = model(**batch()).loss.detach()
    assert torch.equal(loss, stock(**batch()).loss.detach())
    assert "forward hooks" in leantrain.current_report(trainer)["moe4bit"].reasons[0]
    handle.remove()
    leantrain.unpatch_trainer(trainer)

    model = copy.deepcopy(stock)
    trainer = patched(model, tmp_path / "b")

    def broken(*args, **kwargs):
        raise RuntimeError("injected split LoRA failure")

    monkeypatch.setattr(lora_math, "split_lora", broken)
    with pytest.warns(RuntimeWarning, match="moe4bit failed at run time"):
        loss = model(**batch()).loss
    loss.backward()
    assert torch.equal(loss.detach(), stock(**batch()).loss.detach())
    leantrain.unpatch_trainer(trainer)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2"])  # a replaced block forward, a replaced moe step
def test_gradient_checkpointing_matches_plain(family, reentrant, tmp_path):
    """transformers' gradient checkpointing (one checkpoint per decoder layer), both flavours, with LoRA (dropout on)
    on every expert projection: the backward re-runs the grouped path with the same routing and the same dropout
    masks (checkpoint restores the RNG state), so the loss and every gradient equal the same patched model's without
    checkpointing bit for bit (fp32)."""
    plain, ckpt = (lora_model(family, TARGETS[family], lora_dropout=0.1) for _ in range(2))
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        ckpt.enable_input_require_grads()  # what PEFT/TRL do for reentrant checkpointing with frozen embeddings
    trainers = [patched(model, tmp_path / str(i)) for i, model in enumerate((plain, ckpt))]
    torch.manual_seed(0)
    ref_loss, ref_grads = grads_step(plain)
    torch.manual_seed(0)
    loss, grads = grads_step(ckpt)
    assert leantrain.current_report(trainers[1])["moe4bit"].status is Status.APPLIED
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and any(".experts." in k and "lora_B" in k for k in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), f"{name}: {(grad - ref_grads[name]).abs().max():.3g}"
    for trainer in trainers:
        leantrain.unpatch_trainer(trainer)


def test_step_bench_smoke_transformers4(tmp_path, monkeypatch):
    """benchmarks/bench_moe4bit_step.py --smoke --transformers4 (the 4.x per-expert blocks with LoRA on every expert
    projection) runs every provider on CPU, patched (it stops if moe4bit declines), and records the first step."""
    import json

    import bench_moe4bit_step as step

    monkeypatch.setenv("BENCH_RESULTS", str(tmp_path))
    out = step.main(["--smoke", "--transformers4", "--providers", "stock,leantrain"])
    rows = json.loads((out / "moe4bit_step_4x.json").read_text())
    assert {(r["provider"], r["mode"]) for r in rows} >= {("stock", "first step"), ("leantrain", "train step")}
