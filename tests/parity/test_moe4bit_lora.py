"""PEFT LoRA on 4-bit experts through the grouped path (``patch_trainer``) against PEFT's per-expert result on whole
tiny Qwen3-MoE / gpt-oss models: loss, every trainable gradient (expert and attention LoRA, the router), disabled
and multiple adapters, save/reload, decline reasons, the run-time fallback. CPU, seeded.

Two placements: ``target_parameters`` LoRA on 3-D stacks quantized by ``quantize_experts_4bit`` (the reference is
PEFT on the same model with plain stacks holding the dequantized weights: PEFT's own forward is wrong on
parametrized stacks, see ``_adapters.stock_forward``), and PEFT ``lora.Linear4bit`` on every per-expert
``Linear4bit`` (the reference is the same model unpatched: PEFT's per-expert loop).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from leantrain._compat import TRANSFORMERS_3D_EXPERTS, needs


_OLDER = needs("transformers", TRANSFORMERS_3D_EXPERTS, "3-D experts and PEFT target_parameters on them")
if _OLDER:
    pytest.skip(_OLDER, allow_module_level=True)

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

import leantrain  # noqa: E402
from leantrain.moe4bit import _adapters, lora, ops  # noqa: E402
from leantrain.report import Status  # noqa: E402
from testkit.moe4bit_models import convert_model_to_linear4bit_experts  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402
from tests._moe4bit_lora import (  # noqa: E402
    STACK_SUFFIXES,
    _keys,
    base_model,
    batch,
    copy_lora,
    experts_modules,
    list_targets,
    lists_model,
    routers_trainable,
    stacked_pair,
)


ONLY_MOE = others_off("moe4bit")


def make_trainer(model, tmp_path) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=args, train_dataset=[batch(1)["input_ids"][0]] * 2)


def step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch()).loss
    loss.backward()
    keys = _keys(model)
    return loss.detach(), {keys.get(id(p), n): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def patch(model, tmp_path):
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, moe4bit=True, **ONLY_MOE)
    assert report["moe4bit"].status is Status.APPLIED, report["moe4bit"].reasons
    return trainer


def close(ours: torch.Tensor, ref: torch.Tensor, eps: float, terms: int) -> tuple[bool, float, float]:
    """|ours - ref| <= terms * eps * scale: the two paths sum the same products in a different order (W + s·BA
    folded first vs split x·A·B added after the base GEMM), each reordering costs at most an ulp of the scale per
    accumulated term; ``terms`` bounds the accumulation depth that differs (the LoRA rank plus a few adds)."""
    scale = ref.abs().max().item()
    err = (ours.float() - ref.float()).abs().max().item()
    return err <= terms * eps * scale, err, scale


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_stacked_target_parameters_fp32(family, tmp_path):
    quantized, plain = stacked_pair(family)
    routers_trainable(quantized), routers_trainable(plain)
    ref_loss, ref_grads = step(plain)
    trainer = patch(quantized, tmp_path)
    loss, grads = step(quantized)
    outcome = leantrain.current_report(trainer)["moe4bit"]
    assert outcome.status is Status.APPLIED  # no silent fallback
    assert "expert LoRA as split grouped GEMMs on 2 modules" in outcome.detail
    assert grads.keys() == ref_grads.keys()
    assert any("experts.down_proj.lora_A" in k for k in grads) and any(
        k.endswith("mlp.gate.weight") or "router" in k for k in grads
    )
    eps = torch.finfo(torch.float32).eps
    ok, err, scale = close(loss, ref_loss, eps, 64)
    assert ok, (loss, ref_loss)
    for name, grad in grads.items():
        # fp32 gradients pass back through 2 layers of softmax/attention: 4096 ulps of the gradient's scale still
        # sits 3 orders below any real error (a dropped adapter or a wrong expert moves them by O(scale))
        ok, err, scale = close(grad, ref_grads[name], eps, 4096)
        assert ok, f"{name}: {err:.3g} vs scale {scale:.3g}"
    leantrain.unpatch_trainer(trainer)


def test_stacked_target_parameters_bf16(tmp_path):
    quantized, plain = stacked_pair("qwen3_moe", torch.bfloat16)
    exact = copy.deepcopy(plain).float()  # the same (bf16-rounded) weights in fp32: what both bf16 runs estimate
    ref_loss, ref_grads = step(plain)
    _, exact_grads = step(exact)
    trainer = patch(quantized, tmp_path)
    loss, grads = step(quantized)
    eps = 2**-8  # bf16 unit roundoff
    # bf16: the stock path rounds W + s·BA to bf16 before its GEMM, the split path rounds x·A and the LoRA output:
    # a handful of bf16 roundings of each quantity's scale
    assert close(loss, ref_loss, eps, 4)[0], (loss, ref_loss)
    for name, grad in grads.items():
        # A gradient summed over many tokens with cancellation can differ between two bf16 summation orders by more
        # than a few roundings of its scale (seen on other CPUs and peft versions, and on an H100): each path must
        # estimate the fp32 gradient of the same weights as well as the other does, within a factor 2 and a few
        # roundings of the scale.
        _, ours, scale = close(grad, exact_grads[name], eps, 16)
        _, stock, _ = close(ref_grads[name], exact_grads[name], eps, 16)
        assert ours <= 2 * stock + 4 * eps * scale, f"{name}: bf16 error {ours:.3g} vs PEFT's {stock:.3g}"
    leantrain.unpatch_trainer(trainer)


def test_disabled_and_multiple_adapters(tmp_path):
    quantized, plain = stacked_pair("qwen3_moe")
    frozen = base_model("qwen3_moe")
    leantrain.quantize_experts_4bit(frozen)
    base_loss = frozen(**batch()).loss.detach()  # the stock loop on the same 4-bit stacks, no adapters
    cfg = dict(r=8, lora_alpha=8, use_rslora=True, init_lora_weights=False)
    torch.manual_seed(2)
    targets = leantrain.expert_lora_targets(quantized)  # called on the PEFT model: the same list as before
    assert set(targets) == set(quantized.peft_config["default"].target_parameters)
    quantized.add_adapter("second", peft.LoraConfig(target_parameters=targets, **cfg))
    plain.add_adapter("second", peft.LoraConfig(target_parameters=STACK_SUFFIXES, **cfg))
    copy_lora(quantized, plain)
    trainer = patch(quantized, tmp_path)
    with quantized.disable_adapter():
        assert torch.equal(quantized(**batch()).loss.detach(), base_loss)  # fp32 grouped base: bit-exact
    eps = torch.finfo(torch.float32).eps
    for active in (["second"], ["default", "second"]):
        for model in (quantized, plain):
            model.base_model.set_adapter(active)
        ref, ours = plain(**batch()).loss.detach(), quantized(**batch()).loss.detach()
        assert close(ours, ref, eps, 64)[0], (active, ours, ref)
        assert not torch.equal(ours, base_loss)
    leantrain.unpatch_trainer(trainer)


def test_save_pretrained_and_reload(tmp_path):
    quantized, _ = stacked_pair("qwen3_moe")
    trainer = patch(quantized, tmp_path / "a")
    expected = quantized(**batch()).loss.detach()
    quantized.save_pretrained(tmp_path / "adapter")
    leantrain.unpatch_trainer(trainer)
    fresh = base_model("qwen3_moe")
    leantrain.quantize_experts_4bit(fresh)  # the same seeded weights, quantized the same way
    reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter", is_trainable=True)
    trainer = patch(reloaded, tmp_path / "b")
    assert torch.equal(reloaded(**batch()).loss.detach(), expected)
    leantrain.unpatch_trainer(trainer)


def test_auto_mode_serves_lora_on_4bit_stacks_where_peft_cannot(tmp_path):
    """On CPU the measured table keeps the stock experts at these shapes, but PEFT's own forward cannot train LoRA on
    quantized stacks (``_adapters.stock_forward`` says why): auto mode applies the grouped path there, says why, and
    trains as PEFT does on the plain stacks, step after step."""
    quantized, plain = stacked_pair("qwen3_moe")
    trainer = make_trainer(quantized, tmp_path)
    report = leantrain.patch_trainer(trainer, **ONLY_MOE)
    outcome = report["moe4bit"]
    assert outcome.status is Status.APPLIED, outcome.reasons
    assert "PEFT's own forward cannot train LoRA on these 4-bit expert stacks" in outcome.detail
    eps = torch.finfo(torch.float32).eps
    for _ in range(2):  # a second forward is where PEFT's own path fails
        ref_loss, ref_grads = step(plain)
        loss, grads = step(quantized)
        assert close(loss, ref_loss, eps, 64)[0], (loss, ref_loss)
        for name, grad in grads.items():
            assert close(grad, ref_grads[name], eps, 4096)[0], name
    leantrain.unpatch_trainer(trainer)


def test_turning_moe4bit_off_with_lora_on_4bit_stacks_is_an_error_at_patch_time(tmp_path, monkeypatch):
    """``moe4bit=False`` asks for PEFT's own forward, which fails a step in on these stacks: the error comes at
    ``patch_trainer`` time, naming the switch as the user set it and what to do; nothing is patched. Where stock
    trains (no LoRA on the stacks), ``False`` is simply off; the kill switch (stock on purpose) does not raise."""
    quantized, _ = stacked_pair("qwen3_moe")
    trainer = make_trainer(quantized, tmp_path)
    with pytest.raises(ValueError, match=r"moe4bit=False asks for the stock path.*leave moe4bit on auto"):
        leantrain.patch_trainer(trainer, **{**ONLY_MOE, "moe4bit": False})
    monkeypatch.setenv("LEANTRAIN_MOE4BIT", "0")
    with pytest.raises(ValueError, match="LEANTRAIN_MOE4BIT=0 asks for the stock path"):
        leantrain.patch_trainer(trainer, **{k: v for k, v in ONLY_MOE.items() if k != "moe4bit"})
    monkeypatch.delenv("LEANTRAIN_MOE4BIT")
    assert "leantrain_report" not in trainer.__dict__
    report = leantrain.patch_trainer(trainer, **{**ONLY_MOE, "moe4bit": None}, disable=True)
    assert report["moe4bit"].status is Status.DISABLED
    leantrain.unpatch_trainer(trainer)
    model = base_model("qwen3_moe")
    leantrain.quantize_experts_4bit(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    report = leantrain.patch_trainer(make_trainer(model, tmp_path / "b"), **{**ONLY_MOE, "moe4bit": False})
    assert report["moe4bit"].status is Status.DISABLED


def test_auto_mode_keeps_the_measured_rule_without_lora_on_the_stacks(tmp_path):
    """Without PEFT wrappers on the 4-bit stacks the stock experts serve, and the measured table decides."""
    model = base_model("qwen3_moe")
    leantrain.quantize_experts_4bit(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    report = leantrain.patch_trainer(make_trainer(model, tmp_path), **ONLY_MOE)
    reasons = " ".join(report["moe4bit"].reasons)
    assert report["moe4bit"].status is Status.SKIPPED
    assert "on cpu" in reasons and "the stock experts" in reasons


@pytest.mark.expect_fallback
def test_fallback_serves_correct_lora(tmp_path, monkeypatch):
    """A run-time failure falls back to the per-expert stock forward with the adapters folded in (PEFT's own
    forward would drop the inner stack's adapter and fail on the next call)."""
    quantized, plain = stacked_pair("qwen3_moe")
    ref = plain(**batch()).loss.detach()
    trainer = patch(quantized, tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("injected split LoRA failure")

    monkeypatch.setattr(lora, "split_lora", broken)
    with pytest.warns(RuntimeWarning, match="moe4bit failed at run time"):
        first = quantized(**batch()).loss
    first.backward()
    second = quantized(**batch()).loss.detach()
    eps = torch.finfo(torch.float32).eps
    assert close(first.detach(), ref, eps, 64)[0] and torch.equal(second, first.detach())
    assert all(len(p) == 1 for m in experts_modules(quantized) for p in m.parametrizations.values())
    leantrain.unpatch_trainer(trainer)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_linear4bit_lists_lora_fp32(family, tmp_path):
    ref_model = lists_model(family)
    model = copy.deepcopy(ref_model)
    routers_trainable(model), routers_trainable(ref_model)
    ref_loss, ref_grads = step(ref_model)
    trainer = patch(model, tmp_path)
    loss, grads = step(model)
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED
    assert grads.keys() == ref_grads.keys() and any("gate_up_projs.0.lora_A" in k for k in grads)
    eps = torch.finfo(torch.float32).eps
    assert close(loss, ref_loss, eps, 16)[0], (loss, ref_loss)
    for name, grad in grads.items():
        ok, err, scale = close(grad, ref_grads[name], eps, 4096)  # as in the stacked test
        assert ok, f"{name}: {err:.3g} vs scale {scale:.3g}"
    with model.disable_adapter(), ref_model.disable_adapter():
        assert torch.equal(model(**batch()).loss, ref_model(**batch()).loss)  # grouped base: bit-exact in fp32
    leantrain.unpatch_trainer(trainer)


def test_linear4bit_lists_dropout(tmp_path):
    """Dropout p > 0: off in eval (then equal to PEFT's loop), on in training (the mask is per row, drawn once)."""
    ref_model = lists_model(lora_dropout=0.5)
    model = copy.deepcopy(ref_model)
    trainer = patch(model, tmp_path)
    model.eval(), ref_model.eval()
    eps = torch.finfo(torch.float32).eps
    assert close(model(**batch()).loss.detach(), ref_model(**batch()).loss.detach(), eps, 16)[0]
    model.train()
    torch.manual_seed(0)
    a = model(**batch()).loss.detach()
    torch.manual_seed(0)
    assert torch.equal(model(**batch()).loss.detach(), a)  # seeded: reproducible
    assert not torch.equal(a, model.eval()(**batch()).loss.detach())  # and the dropout did apply
    leantrain.unpatch_trainer(trainer)


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"use_dora": True}, "DoRA"),
        ({"lora_bias": True}, "LoRA bias"),
        ({"bias": "all"}, "expert biases require grad"),
    ],
)
def test_lists_declines_with_reason(kwargs, reason, tmp_path):
    model = lists_model(**kwargs)
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, **ONLY_MOE)
    assert report["moe4bit"].status is not Status.APPLIED and reason in report["moe4bit"].reasons[0]
    leantrain.unpatch_trainer(trainer)


def test_lists_declines_other_tuners_and_mixed_ranks(tmp_path):
    model = base_model("gpt_oss")
    convert_model_to_linear4bit_experts(model)
    model = peft.get_peft_model(model, peft.LoHaConfig(r=4, target_modules=list_targets(model)))
    report = leantrain.patch_trainer(make_trainer(model, tmp_path), **ONLY_MOE)
    assert "LoRA only" in report["moe4bit"].reasons[0]
    model = lists_model(rank_pattern={"gate_up_projs.0": 4})
    report = leantrain.patch_trainer(make_trainer(model, tmp_path), **ONLY_MOE)
    assert "differ in their LoRA adapters" in report["moe4bit"].reasons[0]


def test_small_rank_is_padded(tmp_path):
    """Rank 4 in bf16 (8-byte rows) runs padded to 8 and matches PEFT."""
    quantized, plain = stacked_pair("qwen3_moe", torch.bfloat16, r=4, lora_alpha=8)
    assert lora.padded_rank(4, torch.bfloat16) == 8
    ref = plain(**batch()).loss.detach()
    trainer = patch(quantized, tmp_path)
    assert close(quantized(**batch()).loss.detach(), ref, 2**-8, 4)[0]
    leantrain.unpatch_trainer(trainer)


def test_expert_lora_targets_full_names():
    model = base_model("qwen3_moe")
    leantrain.quantize_experts_4bit(model)
    names = leantrain.expert_lora_targets(model)
    assert "model.layers.1.mlp.experts.down_proj" in names and len(names) == 2 * 2 * 3  # layers x stacks x depths
    assert "model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj" in names
    assert _adapters.expert_lora_targets(base_model("qwen3_moe")) == []  # not quantized: PEFT's suffixes work there
    assert ops.ExpertsPlan.__dataclass_fields__["adapters"].default is None


@pytest.mark.expect_fallback
def test_forward_hooks_on_expert_lora_fall_back(tmp_path):
    """PEFT's mixed-adapter batches reach each LoRA layer through forward hooks, which the grouped path never
    calls: with a hook present the call goes to the stock per-expert loop (warned once), with the same result."""
    ref_model = lists_model()
    model = copy.deepcopy(ref_model)
    trainer = patch(model, tmp_path)
    model.base_model.model.model.layers[0].mlp.experts.gate_up_projs[0].register_forward_pre_hook(lambda m, a: None)
    with pytest.warns(RuntimeWarning, match="moe4bit failed at run time"):
        loss = model(**batch()).loss.detach()
    assert torch.equal(loss, ref_model(**batch()).loss.detach())
    assert "forward hooks" in leantrain.current_report(trainer)["moe4bit"].reasons[0]
    leantrain.unpatch_trainer(trainer)


def lora_params(model, factor: str, projection: str = "gate_up_projs") -> list[torch.nn.Parameter]:
    experts = model.base_model.model.model.layers[0].mlp.experts
    return [getattr(m, factor)["default"].weight for m in getattr(experts, projection)]


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_lists_factors_stacked_once_read_in_place(tmp_path, monkeypatch):
    """Patching re-homes each adapter's per-expert factors as slices of one stack per projection: every call's
    grouped GEMMs read those stacks (no copy per call), each parameter's gradient is its slice of one gradient buffer
    (no copy per parameter) and equals PEFT's, an optimizer step on the parameters is seen by the next forward, and
    unpatching gives each parameter private storage again with its values."""
    ref_model = lists_model()
    model = copy.deepcopy(ref_model)
    trainer = patch(model, tmp_path)
    for factor in ("lora_A", "lora_B"):
        for projection in ("gate_up_projs", "down_projs"):
            assert len(storages(lora_params(model, factor, projection))) == 1
    read = []
    real = lora.split_lora

    def spy(x, factors, *args, **kwargs):
        read.append(factors.a.untyped_storage().data_ptr())
        return real(x, factors, *args, **kwargs)

    monkeypatch.setattr(lora, "split_lora", spy)
    eps = torch.finfo(torch.float32).eps
    for step_index in range(2):
        (ref_loss, ref_grads), (loss, grads) = step(ref_model), step(model)
        assert close(loss, ref_loss, eps, 16)[0], (step_index, loss, ref_loss)
        for name, grad in grads.items():
            assert close(grad, ref_grads[name], eps, 4096)[0], name
        assert len(storages(p.grad for p in lora_params(model, "lora_A"))) == 1
        stacks = storages(p for n, p in model.named_parameters() if ".experts." in n and "lora_A" in n)
        assert len(read) == len(stacks) == 4 and set(read) == stacks  # 2 layers x (gate_up, down), each read once
        for m in (ref_model, model):  # the same SGD step on both: the next forward must see it
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p.sub_(0.5 * p.grad)
        read.clear()
        monkeypatch.setattr(lora, "split_lora", spy)
    values = [p.detach().clone() for p in lora_params(model, "lora_B")]
    leantrain.unpatch_trainer(trainer)
    params = lora_params(model, "lora_B")
    assert len(storages(params)) == len(params) and all(torch.equal(p, v) for p, v in zip(params, values))


def test_lists_factors_rehomed_after_patching_are_stacked_per_call(tmp_path):
    """Parameters re-homed after patching (here: one expert's factor replaced by a copy; DeepSpeed's flat buffers or
    an assigning load do the same) and an adapter added after patching are stacked per call: still PEFT's result."""
    ref_model = lists_model()
    model = copy.deepcopy(ref_model)
    trainer = patch(model, tmp_path)
    first = lora_params(model, "lora_A")[0]
    first.data = first.data.clone()
    config = peft.LoraConfig(r=8, lora_alpha=8, target_modules=list_targets(ref_model.get_base_model()))
    for m in (ref_model, model):
        torch.manual_seed(3)
        m.add_adapter("late", config)
        m.base_model.set_adapter(["default", "late"])
        with torch.no_grad():
            for name, param in m.named_parameters():
                if "lora_B.late" in name:
                    param.copy_(torch.full_like(param, 0.01))
    (ref_loss, ref_grads), (loss, grads) = step(ref_model), step(model)
    eps = torch.finfo(torch.float32).eps
    assert leantrain.current_report(trainer)["moe4bit"].status is Status.APPLIED
    assert close(loss, ref_loss, eps, 16)[0], (loss, ref_loss)
    assert any("lora_A.late" in n for n in grads)
    for name, grad in grads.items():
        assert close(grad, ref_grads[name], eps, 4096)[0], name
    leantrain.unpatch_trainer(trainer)


def test_lists_decline_weights_repacked_for_cpu_inference(tmp_path):
    """bitsandbytes repacks a Linear4bit for its CPU kernel at an eval forward without grad (on AVX512-BF16 CPUs):
    those bytes are no longer NF4 blocks, so the probe declines (forced here through the flag bitsandbytes sets)."""
    model = lists_model()
    expert = next(m for m in model.modules() if type(m).__name__ == "Linear4bit")
    expert.weight.quant_state.packing_format_for_cpu = True
    trainer = make_trainer(model, tmp_path)
    report = leantrain.patch_trainer(trainer, **ONLY_MOE)
    assert report["moe4bit"].status is not Status.APPLIED
    assert "repacked by bitsandbytes" in report["moe4bit"].reasons[0], report["moe4bit"].reasons
    leantrain.unpatch_trainer(trainer)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("placement", ["stacked", "lists"])
def test_gradient_checkpointing_matches_plain(placement, reentrant, tmp_path):
    """transformers' gradient checkpointing (one checkpoint per decoder layer) with expert LoRA, both flavours: the
    backward re-runs the grouped path (same routing, same dropout masks: checkpoint restores the RNG state), so the
    loss and every gradient equal the same patched model's without checkpointing bit for bit (fp32)."""

    def make():
        if placement == "stacked":  # target_parameters LoRA refuses dropout
            return stacked_pair("qwen3_moe")[0]
        return lists_model("gpt_oss", lora_dropout=0.1)

    plain, ckpt = make(), make()  # the same seeds: the same weights and adapters
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        ckpt.enable_input_require_grads()  # what PEFT/TRL do for reentrant checkpointing with frozen embeddings
    trainers = []
    for i, model in enumerate((plain, ckpt)):
        routers_trainable(model)
        trainers.append(patch(model, tmp_path / str(i)))
    torch.manual_seed(0)
    ref_loss, ref_grads = step(plain)
    torch.manual_seed(0)
    loss, grads = step(ckpt)
    assert leantrain.current_report(trainers[1])["moe4bit"].status is Status.APPLIED
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys() and any(".experts." in k and "lora_B" in k for k in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), f"{name}: {(grad - ref_grads[name]).abs().max():.3g}"
    for trainer in trainers:
        leantrain.unpatch_trainer(trainer)
