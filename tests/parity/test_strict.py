"""Strict mode fails only for an optimization asked for (``<name>=True``) or one auto mode would apply here on its own,
and with the reason that actually blocks it: every optimization requested alone with ``strict=True``, and none, on a
dense tiny Llama and on tiny gpt-oss MoEs (frozen 4-bit experts; plain experts) under a plain Trainer on CPU.

Version-aware, honestly: on transformers 4.x compile_layers declines (each layer compiles its own graph) and moe4bit
declines gpt-oss' 4-bit experts (their call convention is tested on 5.x); the expected outcome reads the installed
version. Transformers 4.x is also simulated for compile_layers on any installed version (its probe's version read),
and a missing bitsandbytes for moe4bit (its import fails). Here, not in tests/unit, so that CI's floor version sets
run it too (``.ci/matrix.sh`` runs tests/parity there)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import NotReadyError, Status, _compat
from leantrain.cli import tiny
from leantrain.compile_layers import probe as compile_probe
from leantrain.config import OPTIMIZATIONS
from testkit.optimizations import others_off


TRANSFORMERS_5 = _compat.at_least("transformers", _compat.TRANSFORMERS_3D_EXPERTS)
VOCAB = 128
COMPILE_4X = "each decoder layer compiles its own graph"
GPT_OSS_4X = "needs transformers >= 5.0.0 for 3-D MoE experts"


def trainer_for(model: torch.nn.Module, tmp_path) -> Trainer:
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(3, VOCAB, (8, 12))]
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=rows)


def dense(tmp_path) -> Trainer:
    return trainer_for(tiny.tiny_model("llama", vocab_size=VOCAB, hidden=64, layers=2).train(), tmp_path)


def moe(tmp_path, four_bit: bool) -> Trainer:
    """A tiny gpt-oss, its experts frozen nf4 ``Linear4bit`` lists (the checkpoint layout moe4bit serves) or stock."""
    model = tiny.tiny_model("gpt_oss", vocab_size=VOCAB, hidden=64, layers=2).train()
    if four_bit:
        pytest.importorskip("bitsandbytes")
        tiny.linear4bit_experts(model)
        tiny.settle_4bit(model)
    return trainer_for(model, tmp_path)


MODELS = {"dense": dense, "moe_4bit": lambda p: moe(p, True), "moe_plain": lambda p: moe(p, False)}
# What each request alone does under strict mode on CPU, per model: None (applied) or a phrase of the NotReadyError
REQUESTED = {
    "moe4bit": {
        "dense": "moe4bit is required but not ready: LlamaForCausalLM has no MoE experts module",
        "moe_4bit": None if TRANSFORMERS_5 else GPT_OSS_4X,
        "moe_plain": "moe4bit is required but not ready: MoE experts are not 4-bit",
    },
    "osft": dict.fromkeys(MODELS),
    "layer_kernels": {
        "dense": "Liger-Kernel's layer kernels are Triton kernels for CUDA; this trainer runs on cpu",
        "moe_4bit": "no layer kernels for model type 'gpt_oss'",
        "moe_plain": "no layer kernels for model type 'gpt_oss'",
    },
    "compile_layers": {
        "dense": None if TRANSFORMERS_5 else COMPILE_4X,
        # moe4bit (auto) keeps the stock experts on CPU here, whose per-expert loop does not compile as one graph;
        # plain experts compile as the stock code
        "moe_4bit": "MoE layers with 4-bit experts that moe4bit does not serve in this run",
        "moe_plain": None if TRANSFORMERS_5 else COMPILE_4X,
    },
    "fused_ce": dict.fromkeys(MODELS),
    "cggr": dict.fromkeys(MODELS),
    "grpo_logps": dict.fromkeys(MODELS, "grpo_logps is required but not ready: does not apply to plain Trainers"),
    "compile_generation": dict.fromkeys(
        MODELS, "compile_generation is required but not ready: does not apply to plain Trainers"
    ),
    # the test trainers do not checkpoint: nothing to offload, on every version (the first reason checked)
    "offload_checkpoints": dict.fromkeys(MODELS, "activation checkpointing is off"),
    "padding_free": dict.fromkeys(MODELS, "padding_free is required but not ready: does not apply to plain Trainers"),
}


def test_every_optimization_has_its_expectations():
    assert list(REQUESTED) == list(OPTIMIZATIONS) and all(set(v) == set(MODELS) for v in REQUESTED.values())


@pytest.mark.parametrize("model", list(MODELS))
def test_strict_with_nothing_requested_raises_for_nothing_auto_skips(tmp_path, model):
    """Nothing asked for: every optimization auto mode would not apply here on its own (not measured faster on CPU,
    nothing to optimize, off by default) is skipped without an error, whatever blocks it."""
    report = leantrain.patch_trainer(MODELS[model](tmp_path), strict=True, environ={})
    assert report.applied == ()
    assert report["fused_ce"].reasons[0].startswith("not measured on cpu")
    assert report["compile_layers"].reasons[0].startswith("not measured on cpu")


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", list(OPTIMIZATIONS))
def test_strict_with_one_optimization_requested(tmp_path, model, name):
    """One optimization asked for: it applies or raises with its own first blocker; no other optimization (none was
    asked for, none would apply here on its own) makes strict mode raise."""
    expected = REQUESTED[name][model]
    trainer = MODELS[model](tmp_path)
    if expected is not None:
        with pytest.raises(NotReadyError, match=f"^{name} is required but not ready: ") as raised:
            leantrain.patch_trainer(trainer, strict=True, environ={}, **{name: True})
        assert expected in str(raised.value)
        return
    report = leantrain.patch_trainer(trainer, strict=True, environ={}, **{name: True})
    assert report.applied == (name,), report


def test_transformers_4_does_not_fail_strict_on_cpu(tmp_path, monkeypatch):
    """compile_layers declines on transformers 4.x, but on CPU auto mode would not compile the layers anyway (measured
    on CUDA only): strict mode raises only when it is asked for, with the version as the reason."""
    monkeypatch.setattr(compile_probe, "_transformers_version", lambda: "4.57.6")
    report = leantrain.patch_trainer(dense(tmp_path), strict=True, environ={})
    reason = report["compile_layers"].reasons[0]
    assert report["compile_layers"].status is Status.SKIPPED and reason.startswith("not measured on cpu")
    assert f"compile_layers=True would not apply either: on transformers 4.57.6 {COMPILE_4X}" in reason
    asked = f"compile_layers is required but not ready: on transformers 4.57.6 {COMPILE_4X}"
    with pytest.raises(NotReadyError, match=asked):
        leantrain.patch_trainer(dense(tmp_path / "asked"), compile_layers=True, strict=True, environ={})


@pytest.mark.skipif(not TRANSFORMERS_5, reason="gpt-oss' 4-bit expert lists are served from transformers 5 on")
def test_moe4bit_requested_on_a_moe_is_not_blamed_on_compile_layers(tmp_path):
    """moe4bit=True with strict on a 4-bit MoE: compile_layers (never asked for, not measured on MoE families nor on
    CPU) is skipped by its auto rule, and strict mode does not raise for it; asked for, it compiles moe4bit's
    grouped experts."""
    report = leantrain.patch_trainer(moe(tmp_path, True), moe4bit=True, strict=True, environ={})
    assert report["moe4bit"].status is Status.APPLIED
    compile_layers = report["compile_layers"]
    assert compile_layers.status is Status.SKIPPED and compile_layers.reasons[0].startswith("not measured on cpu")
    both = leantrain.patch_trainer(
        moe(tmp_path / "both", True), moe4bit=True, compile_layers=True, strict=True, environ={}
    )
    assert both.applied == ("moe4bit", "compile_layers"), both


def test_without_bitsandbytes_plain_experts_are_not_applicable(tmp_path, monkeypatch):
    """Without bitsandbytes, a MoE whose experts are not 4-bit has nothing for moe4bit to do: that is the reason
    (strict does not raise; moe4bit=True names it), not the missing package. A 4-bit MoE with bitsandbytes failing to
    import gets the install as its reason."""
    four_bit = moe(tmp_path / "4bit", True)
    plain = moe(tmp_path / "plain", False)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    report = leantrain.patch_trainer(plain, strict=True, environ={})
    assert report["moe4bit"].status is Status.SKIPPED and "MoE experts are not 4-bit" in report["moe4bit"].reasons[0]
    leantrain.unpatch_trainer(plain)
    with pytest.raises(NotReadyError, match="moe4bit is required but not ready: MoE experts are not 4-bit"):
        leantrain.patch_trainer(plain, moe4bit=True, strict=True, environ={})
    first = "bitsandbytes not installed" if TRANSFORMERS_5 else GPT_OSS_4X  # 4.x: the version blocks first
    with pytest.raises(NotReadyError, match=f"moe4bit is required but not ready: {first}"):
        leantrain.patch_trainer(four_bit, moe4bit=True, strict=True, environ={}, **others_off("moe4bit"))
