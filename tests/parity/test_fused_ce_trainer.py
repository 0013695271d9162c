"""A plain transformers Trainer on a causal LM with leantrain's fused loss vs stock: the model's own loss
(``ForCausalLMLoss``, ``num_items_in_batch`` under gradient accumulation), its gradients and the trunk-output
gradients, for untied, tied, softcapped and scaled heads, frozen (LoRA) and trainable ones, the MoE aux loss,
evaluation, and the fallbacks. Bounds as in ``test_fused_ce_sft.py`` (V·u in fp32, 4u in bf16)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

import leantrain
from leantrain.report import Status
from tests._fused_ce_trainers import (
    OFF,
    ON,
    UNIT_ROUNDOFF,
    VOCAB,
    assert_window_close,
    batches_of,
    greedy_rows,
    lora,
    measured_here,
    plain_trainer,
    spy_op,
    tiny,
    window,
)


FP32 = VOCAB * UNIT_ROUNDOFF[torch.float32]
BF16 = 4 * UNIT_ROUNDOFF[torch.bfloat16]


def pair(tmp_path, model, peft=None, patch=ON, **args):
    """A patched and a stock trainer on copies of ``model``; the fused loss requested unless ``patch`` says otherwise
    (the tiny head is outside every measured cell)."""
    rows = greedy_rows(model)
    stock_model = copy.deepcopy(model)
    if peft is not None:
        model, stock_model = peft(model), peft(stock_model)
    patched = plain_trainer(model, tmp_path / "p", rows, **args)
    stock = plain_trainer(stock_model, tmp_path / "s", rows, **args)
    report = leantrain.patch_trainer(patched, **patch)
    return patched, stock, report


def run_pair(patched, stock, n=2):
    batches = batches_of(stock, n)
    return window(patched, batches), window(stock, batches)


@pytest.mark.parametrize("head", ["full", "lora"])
def test_window_fp32(tmp_path, head):
    patched, stock, report = pair(tmp_path, tiny(), lora if head == "lora" else None, gradient_accumulation_steps=2)
    outcome = report["fused_ce"]
    assert outcome.status is Status.APPLIED, outcome.reasons
    assert "Trainer.compute_loss" in outcome.detail and ("frozen" in outcome.detail) == (head == "lora")
    ours, ref = run_pair(patched, stock)
    assert_window_close(ours, ref, FP32)


def test_window_bf16(tmp_path):
    patched, stock, _ = pair(tmp_path, tiny(), bf16=True, gradient_accumulation_steps=2)
    ours, ref = run_pair(patched, stock)
    assert_window_close(ours, ref, BF16)


def test_window_without_num_items(tmp_path):
    """A model whose Trainer does not pass num_items_in_batch: the loss is the micro-batch mean, as stock."""
    patched, stock, _ = pair(tmp_path, tiny(), gradient_accumulation_steps=2)
    patched.model_accepts_loss_kwargs = stock.model_accepts_loss_kwargs = False
    ours, ref = run_pair(patched, stock)
    assert_window_close(ours, ref, FP32)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("gemma2", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"head_bias": True}),
        ("cohere", {}),
        ("granite", {}),
        pytest.param(
            "hyperclovax",
            {},
            marks=pytest.mark.skipif(not hasattr(transformers, "HyperCLOVAXConfig"), reason="transformers 5"),
        ),
        ("qwen3_moe", {"output_router_logits": True, "router_aux_loss_coef": 0.02}),
        ("gpt2", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    ],
    ids=["gemma2-softcap", "tied", "bias", "cohere-scale", "granite-scaling", "hyperclovax", "moe-aux", "gpt2"],
)
def test_heads(tmp_path, family, overrides):
    model = tiny(family, **overrides)
    if family == "llama":
        model.tie_weights()
    patched, stock, report = pair(tmp_path, model)
    assert report["fused_ce"].status is Status.APPLIED, report["fused_ce"].reasons
    ours, ref = run_pair(patched, stock, 1)
    assert_window_close(ours, ref, FP32)


def test_modules_to_save_head(tmp_path):
    patched, stock, report = pair(tmp_path, tiny(), lambda m: lora(m, modules_to_save=["lm_head"]))
    assert "trainable" in report["fused_ce"].detail
    ours, ref = run_pair(patched, stock, 1)
    assert any("modules_to_save" in n and "lm_head" in n for n in ref["grads"])
    assert_window_close(ours, ref, FP32)


def test_gradient_checkpointing(tmp_path):
    patched, stock, report = pair(tmp_path, tiny(), lora, gradient_checkpointing=True)
    assert report["fused_ce"].status is Status.APPLIED
    ours, ref = run_pair(patched, stock, 1)
    assert_window_close(ours, ref, FP32)


def test_no_logits_in_training_outputs(tmp_path):
    """The patched training forward returns no [B, T, V] logits: nothing of that size is built or kept."""
    patched, _, _ = pair(tmp_path, tiny())
    seen = []
    handle = patched.model.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        batch = batches_of(patched, 1)[0]
        patched.current_gradient_accumulation_steps = 1
        patched.training_step(patched.model, batch, None)
    finally:
        handle.remove()
    assert seen and seen[0].logits is None and seen[0].loss is not None


def test_train_runs_the_op(tmp_path, monkeypatch):
    """trainer.train() (the collator's BatchEncoding batches, not the dicts the window tests pass): the op serves
    every training step and the logged losses stay with stock."""
    calls = spy_op(monkeypatch)
    patched, stock, _ = pair(tmp_path, tiny(), max_steps=2, gradient_accumulation_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched.train()
        n = len(calls)
        stock.train()
    assert n == 4 and len(calls) == n  # 2 steps x 2 micro-batches, none from the stock trainer
    ours = [h["loss"] for h in patched.state.log_history if "loss" in h]
    ref = [h["loss"] for h in stock.state.log_history if "loss" in h]
    assert ours == pytest.approx(ref, rel=max(FP32, 1e-4))


def test_evaluate(tmp_path, monkeypatch):
    """Loss-only evaluation is served; an evaluation that reads logits (compute_metrics) runs the stock forward."""
    model = tiny()
    patched, stock, _ = pair(tmp_path, model)
    calls = spy_op(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = patched.evaluate()
        served = len(calls)
        ref = stock.evaluate()
        assert served == 1 and len(calls) == served  # 8 rows, one evaluation batch
        assert ours["eval_loss"] == pytest.approx(ref["eval_loss"], rel=FP32)
        shapes = []

        def metrics(pred):
            shapes.append(pred.predictions.shape)
            return {}

        patched.compute_metrics = metrics
        patched.evaluate()
    assert shapes and shapes[0][-1] == VOCAB  # the stock forward's logits reached compute_metrics
    assert len(calls) == served


def test_declines(tmp_path):
    rows = greedy_rows(tiny())
    trainer = plain_trainer(tiny(), tmp_path / "ls", rows, label_smoothing_factor=0.1)
    assert "label smoothing" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)
    trainer = plain_trainer(tiny(), tmp_path / "clf", rows)
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
    assert "compute_loss_func" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)
    # a forward another library replaced on the instance
    model = tiny()
    model.forward = lambda *a, **k: None
    trainer = plain_trainer(model, tmp_path / "fwd", rows)
    assert "replaced on the instance" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)
    # a model accelerate prepared already (its autocast forward would sit outside the fused loss)
    model = tiny()
    model._original_forward = model.forward
    model.forward = model.forward
    trainer = plain_trainer(model, tmp_path / "prepared", rows)
    assert "before the first train()" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)
    # a head it cannot see, and a vision-language model (its text config is a part of its config)
    trainer = plain_trainer(tiny(), tmp_path / "nohead", rows)
    trainer.model.get_output_embeddings = lambda: None
    assert "no output embeddings" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)
    trainer = plain_trainer(tiny(), tmp_path / "vlm", rows)
    text_config = copy.deepcopy(trainer.model.config)
    trainer.model.config.get_text_config = lambda *args, **kwargs: text_config
    assert "vision-language" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)


def test_fsdp_keeps_the_stock_loss_unless_asked(tmp_path, monkeypatch):
    """Under FSDP the whole step measured slower with the fused loss: auto mode keeps the stock loss and quotes the
    measurement, even at a head shape measured faster; fused_ce=True applies it anyway (the distributed tests check
    its numbers under FSDP2)."""
    from leantrain.fused_ce import dispatch

    rows = greedy_rows(tiny())
    trainer = plain_trainer(tiny(), tmp_path / "auto", rows)
    trainer.is_fsdp_enabled = True  # what Trainer.__init__ sets under an FSDP accelerate config
    measured_here(monkeypatch, trainer)  # the op measured faster at this shape: FSDP alone decides
    outcome = leantrain.patch_trainer(trainer, **{**OFF, "fused_ce": None})["fused_ce"]
    assert outcome.status is Status.SKIPPED, outcome
    assert str(dispatch.FSDP2_EVIDENCE) in outcome.reasons[0] and "fused_ce=True" in outcome.reasons[0]
    trainer = plain_trainer(tiny(), tmp_path / "asked", rows)
    trainer.is_fsdp_enabled = True
    outcome = leantrain.patch_trainer(trainer, **{**OFF, "fused_ce": True})["fused_ce"]
    assert outcome.status is Status.APPLIED and "applied on request (fused_ce=True)" in outcome.detail


def test_forced_probe_failure_runs_stock(tmp_path, monkeypatch):
    import leantrain.fused_ce.probe as probe_module

    monkeypatch.setattr(probe_module, "model_reasons", lambda model, path: ["forced for the test"])
    with pytest.raises(leantrain.NotReadyError, match="fused_ce is required but not ready: forced for the test"):
        pair(tmp_path / "asked", tiny())
    patched, stock, report = pair(tmp_path, tiny(), patch=OFF)
    assert report["fused_ce"].status is Status.SKIPPED and "forced for the test" in report["fused_ce"].reasons[0]
    ours, ref = run_pair(patched, stock, 1)
    assert torch.equal(ours["losses"], ref["losses"])


@pytest.mark.expect_fallback
def test_runtime_fallback(tmp_path, monkeypatch):
    patched, stock, _ = pair(tmp_path, tiny())

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    spy_op(monkeypatch, boom)
    batches = batches_of(stock, 2)
    with pytest.warns(RuntimeWarning, match="fused_ce failed at run time"):
        ours = window(patched, batches[:1])
    ref = window(stock, batches[:1])
    assert torch.equal(ours["losses"], ref["losses"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert torch.isfinite(window(patched, batches[1:])["losses"]).all()
    assert leantrain.current_report(patched)["fused_ce"].status is Status.FAILED


def test_patch_unpatch_restores_by_identity(tmp_path):
    trainer = plain_trainer(tiny(), tmp_path, greedy_rows(tiny()))
    model = trainer.model
    names = [(model, "forward"), (trainer, "compute_loss"), (trainer, "prediction_step")]
    before = [obj.__dict__.get(name) for obj, name in names]
    leantrain.patch_trainer(trainer, **ON)
    assert model.__dict__.get("forward") is not None
    print(model)
    leantrain.unpatch_trainer(trainer)
    assert all(obj.__dict__.get(name) is old for (obj, name), old in zip(names, before))


def test_auto_keeps_the_stock_loss_where_not_measured_faster(tmp_path, monkeypatch):
    """The auto rule on a plain Trainer: on this machine's device class with no cell at the head's shape the stock
    loss serves (the report names the measurement, or its absence); fused_ce=True applies the op anyway; a cell
    measured faster here applies it in auto mode, one measured slower keeps the stock loss."""
    from leantrain.fused_ce import dispatch

    rows = greedy_rows(tiny())
    trainer = plain_trainer(tiny(), tmp_path / "auto", rows)
    device = trainer.args.device.type
    outcome = leantrain.patch_trainer(trainer, **OFF)["fused_ce"]
    assert outcome.status is Status.SKIPPED and "compute_loss" not in trainer.__dict__
    assert outcome.reasons[0].startswith("not measured ") and outcome.reasons[0].endswith(
        "the stock loss (the full-logits loss); pass fused_ce=True to apply anyway"
    )
    if dispatch.device_reason(device):  # a CPU: no cell on this device class at all
        assert outcome.reasons[0].startswith(f"not measured on {device} (measured on cuda only: {dispatch.EVIDENCE})")
    leantrain.unpatch_trainer(trainer)
    asked = leantrain.patch_trainer(trainer, **ON)["fused_ce"]
    assert asked.status is Status.APPLIED and "applied on request (fused_ce=True); not measured " in asked.detail
    leantrain.unpatch_trainer(trainer)
    measured_here(monkeypatch, trainer)
    outcome = leantrain.patch_trainer(trainer, **OFF)["fused_ce"]
    assert outcome.status is Status.APPLIED and f"measured at H=64 V={VOCAB} float32 on {device}" in outcome.detail
    leantrain.unpatch_trainer(trainer)
    measured_here(monkeypatch, trainer, faster=False)
    outcome = leantrain.patch_trainer(trainer, **OFF)["fused_ce"]
    assert outcome.status is Status.SKIPPED and outcome.reasons[0].startswith(f"measured at H=64 V={VOCAB} float32")


def test_the_tile_option_reaches_the_op(tmp_path, monkeypatch):
    """fused_ce_tile_mib bounds the op's logits tile (default 256 MiB: below a decoder layer's activations)."""
    from leantrain.lm_head import ops

    tiles: list[int] = []
    real = ops.head_loss

    def spy(*args, **kwargs):
        tiles.append(kwargs["tile_mib"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "head_loss", spy)
    for patch, want in (({**ON, "fused_ce_tile_mib": 3}, 3), (ON, 256)):
        patched, _, _ = pair(tmp_path, tiny(), patch=patch, max_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            patched.train()
        assert tiles.pop() == want and not tiles
