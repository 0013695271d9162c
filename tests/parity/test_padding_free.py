"""Padding-free batches (``padding_free``) on CPU against the trainer's padded batches.

The same rows in one row of real tokens (position ids restarting per row) instead of padded rows: the targets are the
same, the loss is normalized by the same token count, and each row attends to its own tokens only, so in fp32 the
loss and its gradients equal the padded batch's up to the rounding of differently shaped reductions. Bounds: a loss
~5.5 within 16 ulps (eps 1.2e-7); a gradient tensor within 1e-5 of its largest entry (the attention's sums over
differently long key rows reorder fp32 additions: measured differences are ~1e-7 relative). The probe declines, with
a reason a user can act on, where the padding-free batch would not train as the padded one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import leantrain
from leantrain import NotReadyError, Status
from leantrain.cli.tiny import tiny_model
from leantrain.padding_free import probe as pf_probe
from testkit.batches import random_rows
from testkit.optimizations import only


pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("peft")

from tests._fused_ce_trainers import sft_trainer  # noqa: E402
from tests._padding_free import padded_then_packed, skip_unless_ready  # noqa: E402


VOCAB = 256
LENGTHS = (5, 17, 9, 12, 3, 14, 8, 11)  # varying: a padded batch of 4 holds 20-40% padding
EPS = torch.finfo(torch.float32).eps


def trainer_for(tmp_path, attention: str = "sdpa", batch: int = 4, lengths=LENGTHS, **args):
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", vocab_size=VOCAB)
    model.config._attn_implementation = attention
    model = get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)
    )
    rows = [r["input_ids"] for r in random_rows(len(lengths), lengths, VOCAB)]
    return sft_trainer(model.train(), tmp_path, rows, per_device_train_batch_size=batch, max_steps=2, **args)


def force_varlen_plan(monkeypatch) -> None:
    """The plan that swaps the model's SDPA for ``packed_attention`` (on a GPU: flash attention over the rows'
    boundaries), here on the CPU, where that attention runs SDPA over the mask built from the same boundaries: the
    swap, the collator's boundaries and the mask registry are what this exercises."""
    monkeypatch.setattr(pf_probe, "varlen_reasons", lambda model, args: [])


@pytest.mark.parametrize(
    ("attention", "also"),
    [("sdpa", None), ("eager", None), ("sdpa", "fused_ce"), ("sdpa", "compile_layers"), ("varlen", None),
     ("varlen", "fused_ce"), ("varlen", "compile_layers")],
)  # fmt: skip
def test_loss_and_gradients_equal_the_padded_batch(tmp_path, monkeypatch, attention, also):
    """Alone, and with the fused loss or the compiled layers in both runs (what a GPU run applies beside it); varlen:
    the model's SDPA swapped for the attention over the rows' boundaries."""
    if also == "compile_layers" and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("compile_layers declines on transformers 4.x")
    if attention == "varlen":
        force_varlen_plan(monkeypatch)
    trainer = trainer_for(tmp_path, "sdpa" if attention == "varlen" else attention)
    rows = [trainer.train_dataset[i] for i in range(4)]
    # aot_eager: the compiled layer's aten graph without inductor's C++ (the layer tests cover inductor)
    options = {"compile_layers_backend": "aot_eager"} if also == "compile_layers" else {}
    (padded_loss, padded), (loss, grads) = padded_then_packed(trainer, rows, also, **options)
    assert torch.allclose(loss, padded_loss, rtol=16 * EPS, atol=0), (loss, padded_loss)
    layers = trainer.model.config.num_hidden_layers
    assert grads.keys() == padded.keys() and len(grads) == 6 * layers  # q, v, gate: LoRA A and B of every layer
    for name, grad in grads.items():
        scale = padded[name].abs().max()
        assert scale > 0 and (grad - padded[name]).abs().max() <= 1e-5 * scale, name
    assert trainer.padding_free is False  # the trainer's own flag restored too
    assert trainer.model.config._attn_implementation == ("sdpa" if attention == "varlen" else attention)


def test_the_varlen_plan_swaps_the_attention_and_adds_boundaries_an_older_collator_lacks(tmp_path, monkeypatch):
    """An older TRL's collator sends no ``cu_seq_lens_q``: the patch adds the rows' boundaries to its batches, the
    model selects the packed attention while applied, and the undo restores both."""
    from leantrain.padding_free import patch as pf_patch

    force_varlen_plan(monkeypatch)
    trainer = trainer_for(tmp_path)
    skip_unless_ready(trainer)
    collator_type = type(trainer.data_collator)
    stock_call = collator_type.torch_call

    def older(self, examples):
        batch = stock_call(self, examples)
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            batch.pop(key, None)
        return batch

    monkeypatch.setattr(collator_type, "torch_call", older)
    rows = [trainer.train_dataset[i] for i in range(4)]
    report = leantrain.patch_trainer(trainer, **only("padding_free"))
    assert "flash attention over the rows' boundaries" in report["padding_free"].detail
    assert trainer.model.config._attn_implementation == pf_patch.ATTENTION
    batch = trainer.data_collator(rows)
    ends = torch.tensor(LENGTHS[:4]).cumsum(0).tolist()
    assert batch["cu_seq_lens_q"].tolist() == [0, *ends] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert "max_length_q" not in batch  # read by transformers' flash path only; an int would recompile a layer
    leantrain.unpatch_trainer(trainer)
    assert trainer.model.config._attn_implementation == "sdpa"
    assert "cu_seq_lens_q" not in trainer.data_collator(rows) and "torch_call" not in vars(trainer.data_collator)


def test_the_cpu_keeps_the_masks_and_says_why_not_varlen(tmp_path):
    trainer = trainer_for(tmp_path)
    skip_unless_ready(trainer)
    report = leantrain.patch_trainer(trainer, **only("padding_free"))
    assert "not varlen flash attention: the model is not on a CUDA device" in report["padding_free"].detail
    assert trainer.model.config._attn_implementation == "sdpa"
    leantrain.unpatch_trainer(trainer)


def test_training_steps_match_the_padded_run(tmp_path):
    """Two optimizer steps (SGD: each update a fixed multiple of the gradient) give the padded run's losses."""
    losses = {}
    for variant in ("padded", "padding_free"):
        trainer = trainer_for(tmp_path / variant, optim="sgd", learning_rate=0.5)
        skip_unless_ready(trainer)
        options = only("padding_free") if variant == "padding_free" else only("padding_free", False)
        leantrain.patch_trainer(trainer, **options)
        trainer.train()
        losses[variant] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        leantrain.unpatch_trainer(trainer)
    assert len(losses["padded"]) == 2 and losses["padding_free"] == pytest.approx(losses["padded"], rel=64 * EPS)


def auto(trainer) -> leantrain.PatchOutcome:
    skip_unless_ready(trainer)
    outcome = leantrain.patch_trainer(trainer, **only("padding_free", None))["padding_free"]
    leantrain.unpatch_trainer(trainer)
    return outcome


def test_auto_mode_needs_flash_attention_over_the_boundaries(tmp_path):
    outcome = auto(trainer_for(tmp_path))  # the CPU: no varlen plan
    assert outcome.status is Status.SKIPPED
    assert "measured faster only with flash attention over the rows' boundaries" in " ".join(outcome.reasons)
    assert "the model is not on a CUDA device" in " ".join(outcome.reasons)


def test_auto_mode_turns_it_on_where_the_padded_batches_carry_padding(tmp_path, monkeypatch):
    """With the varlen plan: on for rows of varying lengths (LENGTHS: about a third of a padded batch is padding),
    off for rows of one length (with the share it estimated) or batches grouped by length."""
    force_varlen_plan(monkeypatch)
    assert auto(trainer_for(tmp_path / "varying")).status is Status.APPLIED
    same = auto(trainer_for(tmp_path / "same", lengths=(12,) * 8))
    assert same.status is Status.SKIPPED
    assert "would hold 0% padding (estimated from 8 rows), under the 25%" in " ".join(same.reasons)
    field = "train_sampling_strategy" if hasattr(transformers.TrainingArguments, "train_sampling_strategy") else None
    grouped = auto(
        trainer_for(tmp_path / "grouped", **({field: "group_by_length"} if field else {"group_by_length": True}))
    )
    assert grouped.status is Status.SKIPPED and "'group_by_length': auto mode estimates" in " ".join(grouped.reasons)


def test_the_padding_share_of_random_batches():
    from leantrain.padding_free.ops import padding_share

    assert padding_share(torch.tensor([7] * 10), 4) == 0.0
    assert padding_share(torch.tensor([1, 3]), 2) == pytest.approx(1 / 3)  # one batch: 4 real of 6 tokens
    # batches of 2 of rows of 1, 1, 3, 3 tokens: of the 6 pairs, (1, 1) pads to 2 tokens, (3, 3) to 6, and the four
    # (1, 3) to 6 with 2 of padding: 8 of 32 padded tokens are padding
    share = padding_share(torch.tensor([1, 1, 3, 3]), 2, draws=20000)
    expected = 8 / 32
    assert share == pytest.approx(expected, abs=0.01)  # 20000 draws: a standard error under 0.003


def declined(tmp_path, **args) -> str:
    report = leantrain.patch_trainer(trainer_for(tmp_path, **args), **only("padding_free", None))
    assert report["padding_free"].status is Status.SKIPPED
    return " ".join(report["padding_free"].reasons)


def test_nothing_to_do_with_one_row_a_batch_or_a_trainer_that_is_padding_free_already(tmp_path):
    assert "per_device_train_batch_size=1" in declined(tmp_path / "a", batch=1)
    assert "padding-free already" in declined(tmp_path / "b", padding_free=True, max_length=None)


def test_required_but_blocked_names_the_reason(tmp_path, monkeypatch):
    """Forced blockers, each with what stops it: a Trainer counting the loss's tokens before the shift, an attention
    that does not mask packed rows, and a collator whose padding-free batches keep each row's first label."""
    monkeypatch.setattr(pf_probe, "count_reasons", lambda trainer: ["counts the loss's tokens before the shift"])
    with pytest.raises(NotReadyError, match="padding_free is required but not ready: .*before the shift"):
        leantrain.patch_trainer(trainer_for(tmp_path / "a"), padding_free=True)
    monkeypatch.undo()

    trainer = trainer_for(tmp_path / "c")
    trainer.model.config._attn_implementation = "sdpa_paged"
    with pytest.raises(NotReadyError, match="attention 'sdpa_paged'"):
        leantrain.patch_trainer(trainer, padding_free=True)

    trainer = trainer_for(tmp_path / "b")
    if pf_probe.collator_reasons(trainer.data_collator):  # this TRL's own collator fails the check already
        pytest.skip("; ".join(pf_probe.collator_reasons(trainer.data_collator)))
    real = type(trainer.data_collator)

    @dataclasses.dataclass
    class KeepsFirstLabels(real):  # the same name TRL's collator has, so only the behaviour check can tell
        def torch_call(self, examples):
            out = super().torch_call(examples)
            if self.padding_free:
                out["labels"] = out["input_ids"].clone()
            return out

    KeepsFirstLabels.__name__ = real.__name__
    trainer.data_collator = KeepsFirstLabels(**{f.name: getattr(trainer.data_collator, f.name)
                                                for f in dataclasses.fields(real)})  # fmt: skip
    with pytest.raises(NotReadyError, match="keeps each example.s first label"):
        leantrain.patch_trainer(trainer, padding_free=True)


def test_not_for_plain_trainers(tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4)
    report = leantrain.patch_trainer(
        Trainer(model=tiny_model("llama", vocab_size=VOCAB), args=args), **only("padding_free", None)
    )
    assert report["padding_free"].status is Status.SKIPPED
    assert report["padding_free"].reasons == ("does not apply to plain Trainers",)


def test_the_packed_row_rule_names_each_flaw():
    from leantrain.padding_free.ops import packed_batch_problems

    good = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
            "labels": torch.tensor([[5, 6, 7, -100, 9]])}  # fmt: skip
    assert packed_batch_problems(good, [3, 2]) == []
    flawed = {
        "attention mask": {**good, "attention_mask": torch.ones(1, 5)},
        "do not restart": {**good, "position_ids": torch.arange(5)[None]},
        "first label": {**good, "labels": good["input_ids"]},
        "no position ids": {k: v for k, v in good.items() if k != "position_ids"},
    }
    for words, batch in flawed.items():
        (problem,) = packed_batch_problems(batch, [3, 2])
        assert words in problem, (words, problem)
