"""Layer kernels on CPU: the family mapping against the installed transformers, the plan, the bound forwards, the
declines, the run-time fallback and the undo, with torch stand-ins for Liger's Triton ops (testkit/layer_kernels_refs:
the same arguments, the stock arithmetic, counted). Liger's RMSNorm, SwiGLU and GeGLU kernels do not run under
Triton's CPU interpreter (their scalar epsilon and multiplier arguments are plain Python floats there, and the
kernels call ``.to`` on them), so their numerics are held to the stock path on CUDA (tests/gpu); Liger's RoPE kernel
does run there, and ``test_layer_kernels_rope.py`` holds it and the re-scoped attention forward to the stock path.

In fp32 a stand-in is the stock module's arithmetic op for op, so a patched model that routes every call with the
right epsilon, offset, casting mode and activation reproduces the stock model bitwise: the comparisons are exact."""

from __future__ import annotations

import copy
import sys
import types
import warnings
from collections import Counter

import pytest
import torch
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import NotReadyError, Status, _compat
from leantrain.cli.tiny import tiny_model
from leantrain.config import OPTIMIZATIONS
from leantrain.layer_kernels import FAMILIES, MEASURED
from leantrain.layer_kernels.probe import ROPE, rope_reason
from testkit.layer_kernels_refs import emulated


VOCAB = 256
OFF = {name: False for name in OPTIMIZATIONS if name != "layer_kernels"}  # this one alone
# transformers 4.x wraps the attention forwards in @deprecate_kwarg: RoPE is left out there (the report says why)
ROPE_SERVED = _compat.at_least("transformers", "5.0.0")
ROPE_LEFT_OUT = (
    {}
    if ROPE_SERVED
    else {
        f: f"{s.attention_class}.forward is wrapped by a decorator in this transformers version"
        for f, s in FAMILIES.items()
    }
)


def tiny(family: str, layers: int = 2, **overrides) -> torch.nn.Module:
    """A tiny model of ``family`` with non-trivial norm weights (Gemma's are zero at init: (1 + w) would be 1)."""
    model = tiny_model(family, vocab_size=VOCAB, hidden=64, layers=layers, **overrides)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=g))
    return model.train()


def rows(n: int = 8, width: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (n, width), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def trainer_for(model, tmp_path, **args) -> Trainer:
    config = dict(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3,
        per_device_train_batch_size=4, max_steps=2, logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    config.update(args)
    return Trainer(model=model, args=TrainingArguments(**config), train_dataset=rows())


def batch() -> dict[str, torch.Tensor]:
    ids = torch.stack([r["input_ids"] for r in rows(4)])
    return {"input_ids": ids, "labels": ids.clone()}


def loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**batch())
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat([out.loss.detach()[None], out.logits.detach().flatten()]), grads


def patch(trainer, **options):
    return leantrain.patch_trainer(trainer, environ={}, **{**OFF, **options})


def modules_of(model, spec):
    classes = (spec.norm_class, spec.mlp_class, spec.attention_class)
    return [m for m in model.modules() if type(m).__name__ in classes]


# -- the mapping against the installed transformers --------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_mapping_matches_transformers(family):
    spec = FAMILIES[family]
    model = tiny(family)
    modeling = sys.modules[type(model).__module__]
    for cls in (spec.norm_class, spec.mlp_class, spec.attention_class):
        assert getattr(modeling, cls).__module__ == modeling.__name__, cls
    norms = [m for m in model.modules() if type(m).__name__ == spec.norm_class]
    assert norms and all(isinstance(getattr(m, spec.norm_eps), float) for m in norms)
    assert getattr(model.config, spec.act_attr) in spec.activations  # the family's default activation is served
    assert rope_reason(modeling, spec) == ROPE_LEFT_OUT.get(family)  # calls apply_rotary_pos_emb by name
    assert family in MEASURED  # every served family has a verdict (measured or not yet)


# -- the bound forwards reproduce the stock model -----------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_model_equals_stock_and_routes_every_call(family, tmp_path):
    """Every norm, MLP and RoPE call goes through the ops with the family's arguments; fp32: bitwise equal."""
    spec = FAMILIES[family]
    stock = tiny(family)
    model = copy.deepcopy(stock)
    ref_out, ref_grads = loss_and_grads(stock)
    trainer = trainer_for(model, tmp_path)
    with emulated() as calls:
        report = patch(trainer, layer_kernels=True)
        outcome = report["layer_kernels"]
        assert outcome.status is Status.APPLIED, outcome.reasons
        layers = len(model.model.layers)
        norms = len([m for m in model.modules() if type(m).__name__ == spec.norm_class])
        assert len(outcome.targets) == norms + (2 if ROPE_SERVED else 1) * layers
        assert all(t.startswith("model.") for t in outcome.targets)
        out, grads = loss_and_grads(model)
        assert calls == Counter(rms_norm=norms, **{spec.gate: layers}, rope=layers * ROPE_SERVED), calls
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    rope = f"RoPE in {layers} attention forwards" if ROPE_SERVED else f"left out: RoPE: {ROPE_LEFT_OUT[family]}"
    assert rope in outcome.detail
    why = "measured faster on" if MEASURED[family].faster else "applied on request (layer_kernels=True); not measured"
    assert why in outcome.detail


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_unpatch_restores_by_identity_and_transformers_is_never_touched(family, tmp_path):
    spec = FAMILIES[family]
    model = tiny(family)
    modeling = sys.modules[type(model).__module__]
    before = dict(vars(modeling))
    trainer = trainer_for(model, tmp_path)
    with emulated() as calls:
        patch(trainer, layer_kernels=True)
        assert vars(modeling) == before  # nothing process-wide: the module's names are the same objects
        other = tiny(family)  # a model built after the patch runs the stock forwards
        assert not any("forward" in vars(m) for m in other.modules())
        loss_and_grads(other)
        assert not calls
        leantrain.unpatch_trainer(trainer)
        loss_and_grads(model)
        assert not calls
    for module in modules_of(model, spec):
        assert "forward" not in vars(module) and module.forward.__func__ is type(module).forward


def test_deep_copy_rebinds_to_the_copy(tmp_path):
    model = tiny("llama")
    trainer = trainer_for(model, tmp_path)
    with emulated() as calls:
        patch(trainer, layer_kernels=True)
        twin = copy.deepcopy(model)
        norm = twin.model.layers[0].input_layernorm
        assert norm.forward.__self__ is norm  # bound to the copy, not to the original
        with torch.no_grad():
            norm.weight.mul_(2.0)  # the copy's own weight is the one its forward reads
        assert not torch.equal(twin(**batch()).logits, model(**batch()).logits)
        assert calls["rms_norm"] > 0


def test_peft_and_gradient_checkpointing_train_as_stock(tmp_path):
    """LoRA on every projection, activation checkpointing (recomputed forwards run the bound ones too), two steps."""
    peft = pytest.importorskip("peft")

    def run(patched: bool):
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        model = peft.get_peft_model(tiny("llama"), lora)
        checkpointing = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer = trainer_for(model, tmp_path / str(patched), **checkpointing)
        if patched:
            with emulated() as calls:
                assert patch(trainer, layer_kernels=True)["layer_kernels"].status is Status.APPLIED
                trainer.train()
                assert calls["rms_norm"] > 0 and calls["swiglu"] > 0
        else:
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    (stock_losses, stock_params), (losses, params) = run(False), run(True)
    assert losses == stock_losses and all(torch.equal(params[n], stock_params[n]) for n in params)


def test_regional_compile_traces_the_bound_forwards(tmp_path):
    """``layer.compile()`` after the patch: Dynamo traces the bound forwards, the re-scoped attention and the guard
    (backend "eager": the graph capture without code generation; the CUDA tests compile with inductor)."""
    stock = tiny("gemma2")
    model = copy.deepcopy(stock)
    ref_out, ref_grads = loss_and_grads(stock)
    trainer = trainer_for(model, tmp_path)
    with emulated() as calls:
        patch(trainer, layer_kernels=True)
        for layer in model.model.layers:
            layer.compile(backend="eager")
        out, grads = loss_and_grads(model)
        assert calls["geglu"] and (calls["rope"] or not ROPE_SERVED)  # traced through the stand-ins (counted then)
    torch._dynamo.reset()
    assert torch.equal(out, ref_out) and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


# -- defaults and declines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_auto_applies_only_where_measured_faster(family, tmp_path):
    trainer = trainer_for(tiny(family), tmp_path)
    with emulated():
        outcome = patch(trainer)["layer_kernels"]
    if MEASURED[family].faster:
        assert outcome.status is Status.APPLIED and f"measured faster on {family}" in outcome.detail
    else:
        assert outcome.status is Status.SKIPPED
        (reason,) = outcome.reasons
        assert reason.startswith(f"not measured faster on {family} (") and "layer_kernels=True" in reason


def test_cpu_declines_in_auto_and_raises_when_required(tmp_path):
    trainer = trainer_for(tiny("gemma2"), tmp_path)
    outcome = patch(trainer)["layer_kernels"]
    assert (
        outcome.status is Status.SKIPPED and "Triton kernels for CUDA; this trainer runs on cpu" in outcome.reasons[0]
    )
    leantrain.unpatch_trainer(trainer)
    with pytest.raises(NotReadyError, match="layer_kernels is required but not ready: .*runs on cpu"):
        patch(trainer, layer_kernels=True)


def test_declines_when_liger_kernel_is_not_installed(tmp_path, monkeypatch):
    from leantrain.layer_kernels import LayerKernels, probe

    real = probe.liger_reason
    trainer = trainer_for(tiny("gemma2"), tmp_path)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # find_spec answers None: not installed
    with emulated():
        probe.liger_reason = real  # only the device check emulated (restored by emulated())
        outcome = patch(trainer)["layer_kernels"]
    assert outcome.status is Status.SKIPPED
    assert outcome.reasons == ("liger_kernel is not installed: pip install 'liger-kernel>=0.8.5'",)
    assert LayerKernels().check_environment()[0] == "liger_kernel is not installed: pip install 'liger-kernel>=0.8.5'"
    assert (
        "needs CUDA (Liger-Kernel's kernels are Triton kernels for CUDA)" in LayerKernels().check_environment()
    ) == (not torch.cuda.is_available())


def test_declines_under_use_liger_kernel(tmp_path):
    trainer = trainer_for(tiny("gemma2"), tmp_path)
    trainer.args.use_liger_kernel = True  # set after init: transformers 4.x checks for liger_kernel at init
    with emulated():
        outcome = patch(trainer)["layer_kernels"]
    assert outcome.status is Status.SKIPPED and outcome.reasons[0].startswith("use_liger_kernel=True: the trainer")


def test_declines_modules_another_library_patched(tmp_path):
    model = tiny("llama")
    norm = model.model.layers[1].post_attention_layernorm
    norm.forward = types.MethodType(lambda self, x: x, norm)  # what an instance-level patch leaves behind
    trainer = trainer_for(model, tmp_path)
    with emulated():
        outcome = patch(trainer, layer_kernels=None)["layer_kernels"]
        assert outcome.status is Status.SKIPPED  # llama: auto declines first (not measured); ask for it:
        leantrain.unpatch_trainer(trainer)
        with pytest.raises(NotReadyError, match=r"model\.layers\.1\.post_attention_layernorm already runs .*another"):
            patch(trainer, layer_kernels=True)


def test_declines_a_process_wide_patch(tmp_path, monkeypatch):
    model = tiny("gemma2")
    modeling = sys.modules[type(model).__module__]
    liger_rope = types.FunctionType(modeling.apply_rotary_pos_emb.__code__, {})
    liger_rope.__module__ = "liger_kernel.transformers.rope"
    monkeypatch.setattr(modeling, ROPE, liger_rope)
    trainer = trainer_for(model, tmp_path)
    with emulated():
        outcome = patch(trainer)["layer_kernels"]
    assert outcome.status is Status.SKIPPED
    assert (
        "modeling module was patched for the whole process (apply_rotary_pos_emb is liger_kernel" in outcome.reasons[0]
    )


def test_unserved_family_and_grpo_auto_are_not_due(tmp_path):
    from leantrain.config import resolve_config
    from leantrain.fallback import RuntimeFallback
    from leantrain.layer_kernels.probe import probe
    from leantrain.optimization import PatchContext

    trainer = trainer_for(tiny("gpt2"), tmp_path)
    with emulated():
        outcome = patch(trainer, strict=True)["layer_kernels"]  # strict: nothing to optimize is not an error
        assert outcome.status is Status.SKIPPED
        assert outcome.reasons[0].startswith("no layer kernels for model type 'gpt2'")
        ctx = PatchContext(resolve_config({}, environ={}), "grpo", RuntimeFallback("layer_kernels", False))
        readiness = probe(trainer_for(tiny("gemma2"), tmp_path), ctx)
    # GRPO: not measured there, so auto mode would not apply the kernels (strict does not raise): the auto rule
    assert not readiness.ready and not readiness.due and not readiness.blocked
    assert readiness.slower_evidence.startswith("measured on SFT training steps only, not on grpo trainers")


def test_activation_the_kernel_does_not_compute_leaves_the_mlp_out(tmp_path):
    model = tiny("llama", hidden_act="gelu")
    trainer = trainer_for(model, tmp_path)
    with emulated() as calls:
        outcome = patch(trainer, layer_kernels=True)["layer_kernels"]
        loss_and_grads(model)
    assert outcome.status is Status.APPLIED and "left out: swiglu MLP: the activation is 'gelu'" in outcome.detail
    assert calls["swiglu"] == 0 and calls["rms_norm"] > 0


# -- run-time fallback -------------------------------------------------------------------------------------------


@pytest.mark.expect_fallback
def test_runtime_failure_falls_back_once_and_training_goes_on(tmp_path):
    from leantrain.layer_kernels import ops

    stock = tiny("gemma2")
    model = copy.deepcopy(stock)
    ref_out, ref_grads = loss_and_grads(stock)
    trainer = trainer_for(model, tmp_path)
    with emulated() as calls:
        patch(trainer, layer_kernels=True)

        def broken(*args):
            calls["broken"] += 1
            raise RuntimeError("injected kernel failure")

        ops.rms_norm = broken  # restored by emulated()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, grads = loss_and_grads(model)
            loss_and_grads(model)
        assert calls["broken"] == 1  # tried once (the first norm of the first forward), then stock everywhere:
        assert calls["geglu"] == calls["rope"] == 0  # one guard per optimization, shared by its kernels
    assert len([w for w in caught if "layer_kernels failed at run time" in str(w.message)]) == 1
    outcome = leantrain.current_report(trainer)["layer_kernels"]
    assert outcome.status is Status.FAILED and "injected kernel failure" in outcome.reasons[0]
    assert torch.equal(out, ref_out) and all(torch.equal(grads[n], ref_grads[n]) for n in grads)
