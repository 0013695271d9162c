"""OSFT through patch_trainer: SFTTrainer training, dense save_model, checkpoint resume, refusals, undo, fallbacks."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain.cli.tiny import corpus_texts, tiny_model, train_tokenizer
from leantrain.entry import NotReadyError
from leantrain.osft import OSFTCallback, OSFTLinear, frozen_overlap, osft_layers
from leantrain.report import Status


torch.set_num_threads(1)
VOCAB = 256
AUTO = {"LEANTRAIN_OSFT": "auto"}  # osft is opt-in; auto mode applies it when the probe passes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def plain_trainer(tmp_path, steps: int = 4, optimizers=(None, None), **args) -> Trainer:
    model = tiny_model("llama", vocab_size=VOCAB, layers=2).train()
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(3, VOCAB, (32, 16), generator=generator)]
    config = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **{"save_strategy": "no", **args},
    )
    return Trainer(model=model, args=config, train_dataset=rows, optimizers=optimizers)


def ids(length: int = 12) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
def test_sft_trainer_trains_and_keeps_the_frozen_subspace(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokenizer = train_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), layers=2)
    args = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=10,
        learning_rate=3e-3,
        logging_steps=1,
        max_length=48,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"text": corpus_texts()[:40]})
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    report = leantrain.patch_trainer(trainer, osft=True, osft_unfrozen_rank_ratio=0.25)
    assert report["osft"].status is Status.APPLIED and len(report["osft"].targets) == 14
    layers = osft_layers(trainer.model)
    w0 = {n: layer.dense_weight(torch.float64) for n, layer in layers.items()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.05  # it learns
    for name, layer in layers.items():
        dw = layer.dense_weight(torch.float64) - w0[name]
        assert dw.norm() > 0  # the target trained
        u, v = layer.U_high.double(), layer.V_high.double()
        # fp32, 10 AdamW steps: the frozen-subspace components stay at rounding (measured ~1e-7 relative).
        assert float((u.t() @ dw).norm() / dw.norm()) <= 1e-5
        assert float((dw @ v.t()).norm() / dw.norm()) <= 1e-5
        assert frozen_overlap(layer) <= 1e-6


@pytest.mark.slow
def test_save_model_writes_dense_weights_and_checkpoints_resume(tmp_path):
    trainer = plain_trainer(tmp_path / "run", steps=4, save_strategy="steps", save_steps=2)
    leantrain.patch_trainer(trainer, osft=True)
    trainer.train()
    trainer.model.eval()
    with torch.no_grad():
        trained = trainer.model(ids()).logits
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    # Checkpoints keep the factors (exact resume) ...
    ckpt = load_file(os.path.join(tmp_path, "run", "checkpoint-2", "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.V_high" in ckpt and "model.layers.0.self_attn.q_proj.weight" not in ckpt
    # ... while save_model() exports dense weights that stock from_pretrained loads.
    trainer.save_model(str(tmp_path / "export"))
    exported = load_file(os.path.join(tmp_path, "export", "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in exported and not any("U_high" in k for k in exported)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no missing / unexpected key warnings
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager")
    with torch.no_grad():
        assert rel(reloaded(ids()).logits, trained) <= 1e-5  # fp32 rebuild vs factored forward

    resumed = plain_trainer(tmp_path / "run", steps=4, save_strategy="steps", save_steps=2)
    leantrain.patch_trainer(resumed, osft=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    for name, param in resumed.model.named_parameters():
        # same data order, RNG and optimizer state restored: only reduction-order rounding may differ.
        assert torch.allclose(param, final[name], rtol=1e-5, atol=1e-7), name


def test_existing_optimizer_is_refused(tmp_path):
    model_for_opt = tiny_model("llama", vocab_size=VOCAB, layers=2)
    trainer = plain_trainer(tmp_path, optimizers=(torch.optim.SGD(model_for_opt.parameters(), lr=0.1), None))
    with pytest.raises(NotReadyError, match="already has an optimizer"):
        leantrain.patch_trainer(trainer, osft=True)
    assert not osft_layers(trainer.model)
    report = leantrain.patch_trainer(trainer, environ=AUTO)  # auto: skipped, with the reason
    assert report["osft"].status is Status.SKIPPED and "optimizer" in report["osft"].reasons[0]
    assert not osft_layers(trainer.model)


def test_bad_user_input_errors_at_patch_time(tmp_path):
    trainer = plain_trainer(tmp_path)
    with pytest.raises(ValueError, match="'nope_proj'"):
        leantrain.patch_trainer(trainer, osft=True, osft_targets=["q_proj", "nope_proj"])
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            leantrain.patch_trainer(trainer, osft=True, osft_unfrozen_rank_ratio=bad)
    assert not osft_layers(trainer.model) and leantrain.current_report(trainer) is None


def test_off_by_default_and_user_targets(tmp_path):
    trainer = plain_trainer(tmp_path)
    assert leantrain.patch_trainer(trainer)["osft"].status is Status.DISABLED
    leantrain.unpatch_trainer(trainer)
    report = leantrain.patch_trainer(trainer, osft=True, osft_targets=["*.mlp.down_proj"])
    assert report["osft"].targets == ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj")
    assert isinstance(trainer.model.model.layers[0].self_attn.q_proj, nn.Linear)


def test_options_reach_the_projector(tmp_path):
    trainer = plain_trainer(tmp_path)
    report = leantrain.patch_trainer(trainer, osft=True, osft_cache_v_high=True, osft_projection_precision="fp32")
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, OSFTCallback))
    assert callback.projector.cache_v_high and callback.projector.precision == "fp32"
    assert "gathered V_high cached" in report["osft"].detail
    leantrain.unpatch_trainer(trainer)
    leantrain.patch_trainer(trainer, osft=True)
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, OSFTCallback))
    assert not callback.projector.cache_v_high and callback.projector.precision == "tf32x3"


def test_unpatch_restores_modules_methods_and_callbacks(tmp_path):
    trainer = plain_trainer(tmp_path, steps=2)
    modules = dict(trainer.model.named_modules())
    callbacks = list(trainer.callback_handler.callbacks)
    leantrain.patch_trainer(trainer, osft=True)
    assert any(isinstance(c, OSFTCallback) for c in trainer.callback_handler.callbacks)
    assert "save_model" in trainer.__dict__ and "_save" in trainer.__dict__
    trainer.train()
    trained = {n: layer.dense_weight() for n, layer in osft_layers(trainer.model).items()}
    leantrain.unpatch_trainer(trainer)
    assert dict(trainer.model.named_modules()) == modules  # every original module object is back
    assert trainer.callback_handler.callbacks == callbacks
    assert "save_model" not in trainer.__dict__ and "_save" not in trainer.__dict__
    for name, weight in trained.items():  # holding the trained weights, merged
        assert torch.equal(trainer.model.get_submodule(name).weight, weight)
    # The optimizer was built on the factors: dropped, so a later train() optimizes the dense weights again.
    assert trainer.optimizer is None and trainer.lr_scheduler is None


@pytest.mark.expect_fallback
def test_runtime_failure_falls_back_to_the_simple_projection(tmp_path):
    trainer = plain_trainer(tmp_path, steps=3)
    leantrain.patch_trainer(trainer, osft=True)
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, OSFTCallback))

    def broken() -> None:
        raise RuntimeError("injected projection failure")

    callback.projector.project_gradients = broken
    with pytest.warns(RuntimeWarning, match="injected projection failure"):
        trainer.train()
    outcome = leantrain.current_report(trainer)["osft"]
    assert outcome.status is Status.FAILED and "injected" in outcome.reasons[0]
    # the simple path projected instead: still orthogonal
    assert max(frozen_overlap(layer) for layer in osft_layers(trainer.model).values()) <= 1e-6


def test_peft_lora_model_has_no_trainable_targets(tmp_path):
    from peft import LoraConfig, get_peft_model

    trainer = plain_trainer(tmp_path)
    trainer.model = get_peft_model(trainer.model, LoraConfig(r=2, target_modules=["q_proj"]))
    report = leantrain.patch_trainer(trainer, environ=AUTO)
    assert report["osft"].status is Status.SKIPPED and "frozen" in report["osft"].reasons[0]
    assert not any(isinstance(m, OSFTLinear) for m in trainer.model.modules())
