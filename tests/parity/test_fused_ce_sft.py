"""TRL's SFTTrainer with leantrain's fused loss vs stock, on the TRL path the installed version takes: TRL >= 1.15's
fused head (``nll``, ``dft``), TRL 1.4-1.14's ``chunked_nll``, and TRL <= 1.14's full-logits ``nll`` and ``dft``.

Each test runs one gradient-accumulation window (2 micro-batches, the trainer's own ``num_items_in_batch``) through
``training_step`` on two copies of one tiny model and compares the micro-batch losses, every parameter gradient, the
gradient at the trunk's output (the hidden states), and the logged ``entropy`` / ``mean_token_accuracy`` /
``num_tokens`` / ``aux_loss``.

Bounds: the loss, its gradients and the entropy are sums over the vocabulary that the two sides round in different
orders; one rounding per term bounds the relative error by V·u (V = 512, u the unit roundoff: fp32 2^-24). In bf16
autocast both sides round each logit to bf16 once (the stock logits, leantrain's tiles) and the gradient's
probabilities once more (stock: dL/dlogits cast to bf16; leantrain: the e·f tile), so 4u (u = 2^-8) bounds it.
Token accuracy is exact in fp32; in bf16 it may differ on tokens whose top two logits lie within a rounding of each
other, and only there.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch


trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import leantrain  # noqa: E402
from leantrain.fused_ce import dispatch  # noqa: E402
from leantrain.report import Status  # noqa: E402
from tests._fused_ce_trainers import (  # noqa: E402
    OFF,
    ON,
    UNIT_ROUNDOFF,
    VOCAB,
    assert_accuracy,
    assert_window_close,
    batches_of,
    greedy_rows,
    has_fused_head,
    lora,
    measured_here,
    sft_paths,
    sft_trainer,
    spy_op,
    tiny,
    window,
)


PATHS = sft_paths()
FP32 = VOCAB * UNIT_ROUNDOFF[torch.float32]
BF16 = 4 * UNIT_ROUNDOFF[torch.bfloat16]


def pair(tmp_path, model, loss_type=None, peft=None, rows=None, patch=ON, measured=None, **args):
    """(patched, stock, report) SFTTrainers on deep copies of ``model``: the fused loss requested unless ``patch``
    says otherwise (the tiny head is outside every measured cell); ``measured`` (a monkeypatch): the dispatch rule
    measures leantrain's op faster at this head first."""
    rows = rows if rows is not None else greedy_rows(model)
    stock_model = copy.deepcopy(model)
    if peft is not None:
        model, stock_model = peft(model), peft(stock_model)
    patched = sft_trainer(model, tmp_path / "p", rows, loss_type=loss_type, **args)
    stock = sft_trainer(stock_model, tmp_path / "s", rows, loss_type=loss_type, **args)
    if measured is not None:
        measured_here(measured, patched)
    report = leantrain.patch_trainer(patched, **patch)
    return patched, stock, report


def run_pair(patched, stock, n=2):
    batches = batches_of(stock, n)
    return window(patched, batches), window(stock, batches)


def assert_served(report, path):
    outcome = report["fused_ce"]
    assert outcome.status is Status.APPLIED, outcome.reasons
    words = {"trl_fused": "fused LM head", "chunked_nll": "chunked_nll", "full_logits": "nll over", "dft": "dft over"}
    assert words[path] in outcome.detail


@pytest.mark.parametrize("head", ["full", "lora"])
@pytest.mark.parametrize(("loss_type", "path"), PATHS)
def test_window_fp32(tmp_path, loss_type, path, head):
    patched, stock, report = pair(
        tmp_path, tiny(), loss_type, lora if head == "lora" else None, gradient_accumulation_steps=2
    )
    assert_served(report, path)
    assert (head == "lora") == ("frozen" in report["fused_ce"].detail)
    assert (path == "trl_fused") == ("scalar-loss gradient" in report["fused_ce"].detail)
    ours, ref = run_pair(patched, stock)
    assert_window_close(ours, ref, FP32, FP32)
    assert_accuracy(ours, ref)
    assert 0 < ref["metrics"]["mean_token_accuracy"][0] < 1  # the test data exercises the argmax test


def near_tie_shares(model, batches):
    """Per micro-batch: the share of labelled tokens whose top two bf16 logits lie within a bf16 rounding of the
    larger one (the only tokens whose argmax may flip between two bf16 computations)."""
    u = UNIT_ROUNDOFF[torch.bfloat16]
    shares = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for b in batches:
            logits = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask")).logits.float()
            top = logits[:, :-1].topk(2, dim=-1).values
            mask = b["labels"][:, 1:] != -100
            near = (top[..., 0] - top[..., 1]) <= 4 * u * top[..., 0].abs()
            shares.append(((near & mask).sum() / mask.sum()).item())
    return shares


@pytest.mark.parametrize(("loss_type", "path"), PATHS)
def test_window_bf16(tmp_path, loss_type, path):
    patched, stock, report = pair(tmp_path, tiny(), loss_type, bf16=True, gradient_accumulation_steps=2)
    assert_served(report, path)
    batches = batches_of(stock, 2)
    allowed = near_tie_shares(stock.model, batches)
    ours, ref = window(patched, batches), window(stock, batches)
    # TRL <= 1.14's dft_loss takes the log-softmax of the bf16 logits in bf16 (selective_log_softmax), then exp and
    # the weighting: four more bf16 roundings on the stock side
    bound = 2 * BF16 if path == "dft" else BF16
    assert_window_close(ours, ref, bound, bound)
    assert_accuracy(ours, ref, allowed)  # one logged value per micro-batch


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("gemma2", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"head_bias": True}),
        ("cohere", {}),
        ("granite", {}),
    ],
    ids=["gemma2-softcap", "llama-tied", "llama-bias", "cohere-logit_scale", "granite-logits_scaling"],
)
def test_heads(tmp_path, family, overrides):
    loss_type, path = PATHS[0]
    model = tiny(family, **overrides)
    if family == "llama":
        model.tie_weights()
    if path == "chunked_nll" and family == "granite":
        # TRL's chunked cross-entropy ignores Granite's logits_scaling; leantrain keeps TRL's path, even when asked
        with pytest.raises(leantrain.NotReadyError, match="fused_ce is required but not ready: .*logit_scale"):
            pair(tmp_path, model, loss_type)
        return
    patched, stock, report = pair(tmp_path, model, loss_type)
    assert_served(report, path)
    ours, ref = run_pair(patched, stock, 1)
    assert_window_close(ours, ref, FP32, FP32)
    assert_accuracy(ours, ref)


@pytest.mark.parametrize("masks", ["completion", "assistant"])
@pytest.mark.parametrize(("loss_type", "path"), PATHS)
def test_label_masks(tmp_path, loss_type, path, masks):
    """Completion-only and assistant-only losses: the collator's -100 labels."""
    patched, stock, report = pair(tmp_path, tiny(), loss_type, masks=masks)
    assert_served(report, path)
    batches = batches_of(stock, 1)
    assert (batches[0]["labels"] == -100).sum() > (batches[0]["attention_mask"] == 0).sum() + 4  # prompts masked
    ours, ref = window(patched, batches), window(stock, batches)
    assert_window_close(ours, ref, FP32, FP32)
    assert_accuracy(ours, ref)


@pytest.mark.parametrize("packing", [False, True], ids=["padding_free", "packed"])
@pytest.mark.parametrize(("loss_type", "path"), PATHS)
def test_padding_free(tmp_path, loss_type, path, packing):
    """One row of concatenated sequences with position_ids (no attention mask); packed: TRL's bfd packing."""
    args = dict(packing=True, packing_strategy="bfd", max_length=64) if packing else dict(max_length=None)
    patched, stock, report = pair(tmp_path, tiny(), loss_type, padding_free=True, **args)
    assert_served(report, path)
    batches = batches_of(stock, 1)
    assert "position_ids" in batches[0] and batches[0]["input_ids"].shape[0] == 1
    ours, ref = window(patched, batches), window(stock, batches)
    assert_window_close(ours, ref, FP32, FP32)
    assert_accuracy(ours, ref)


def test_moe_aux_loss(tmp_path):
    loss_type, path = PATHS[0]
    model = tiny("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.02)
    patched, stock, report = pair(tmp_path, model, loss_type)
    assert_served(report, path)
    ours, ref = run_pair(patched, stock, 1)
    assert ref["metrics"]["aux_loss"]
    assert_window_close(ours, ref, FP32, FP32)


def test_modules_to_save_head(tmp_path):
    """A trainable head under PEFT (``modules_to_save``): the op reads the active copy's weight and trains it."""
    loss_type, path = PATHS[0]
    patched, stock, report = pair(tmp_path, tiny(), loss_type, lambda m: lora(m, modules_to_save=["lm_head"]))
    assert_served(report, path)
    assert "trainable" in report["fused_ce"].detail
    ours, ref = run_pair(patched, stock, 1)
    assert any("modules_to_save" in n and "lm_head" in n for n in ref["grads"])
    assert_window_close(ours, ref, FP32, FP32)


def test_trajectory(tmp_path, monkeypatch):
    """Three optimizer steps of 2 accumulated micro-batches through ``train()``: the op serves every micro-batch;
    logged loss, grad norm, entropy and token accuracy stay with stock (a dropped accumulation normalizer would
    drift one way)."""
    loss_type, path = PATHS[0]
    calls = spy_op(monkeypatch)
    patched, stock, report = pair(tmp_path, tiny(), loss_type, gradient_accumulation_steps=2, max_steps=3)
    assert_served(report, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched.train()
        n = len(calls)
        stock.train()
    assert n >= 6 and len(calls) == n  # every micro-batch (TRL 0.x: a second, no-grad call for its entropy)
    keys = ("loss", "grad_norm", "entropy", "mean_token_accuracy")
    ours = [h for h in patched.state.log_history if "loss" in h]
    ref = [h for h in stock.state.log_history if "loss" in h]
    assert len(ours) == len(ref) == 3
    for a, b in zip(ours, ref):
        for key in keys:
            # logged values are rounded for display on some transformers versions: compare at 4 significant digits
            assert a[key] == pytest.approx(b[key], rel=max(FP32, 1e-4), abs=1e-6), (key, a[key], b[key])


def test_cggr_composes(tmp_path):
    """CGGR masks labels inside the forward; the fused loss reads those masked labels: cggr + fused_ce equals
    cggr alone."""
    loss_type, path = PATHS[0]
    model = tiny()
    rows = greedy_rows(model)
    opts = dict(cggr=True, cggr_min_tokens_ratio=0.5, cggr_warmup_steps=0, moe4bit=False, grpo_logps=False, osft=False)
    both = sft_trainer(model, tmp_path / "b", rows, loss_type=loss_type)
    alone = sft_trainer(copy.deepcopy(model), tmp_path / "a", rows, loss_type=loss_type)
    report = leantrain.patch_trainer(both, fused_ce=True, **opts)
    assert report["fused_ce"].status is Status.APPLIED and report["cggr"].status is Status.APPLIED
    leantrain.patch_trainer(alone, fused_ce=False, **opts)
    batches = batches_of(alone, 2)
    ours, ref = window(both, batches), window(alone, batches)
    assert ref["metrics"]["mean_token_accuracy"]
    assert_window_close(ours, ref, FP32, FP32)
    assert_accuracy(ours, ref)


@pytest.mark.skipif(not has_fused_head(), reason="TRL >= 1.15's own fused head")
@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_trl_head_per_token_gradient(tmp_path, monkeypatch, loss_type):
    """Where TRL's compute_loss is not the weighted sum the probe knows, the log-probs carry their own gradient
    (per-token path); both paths equal stock."""
    import leantrain.fused_ce.probe as probe_module

    monkeypatch.setattr(probe_module, "_TRL_LINEAR_LOSS", ("a line no TRL has",))
    patched, stock, report = pair(tmp_path, tiny(), loss_type)
    assert "scalar-loss gradient" not in report["fused_ce"].detail
    ours, ref = run_pair(patched, stock, 1)
    assert_window_close(ours, ref, FP32, FP32)


# ----------------------------------------------------------------------------------------------- declines
def test_declines_with_reasons(tmp_path):
    loss_type, _ = PATHS[0]
    rows = greedy_rows(tiny())
    cases = {
        "label_smoothing_factor": dict(label_smoothing_factor=0.1),
    }
    for what, args in cases.items():
        trainer = sft_trainer(tiny(), tmp_path / what, rows, loss_type=loss_type, **args)
        report = leantrain.patch_trainer(trainer, **OFF)
        assert report["fused_ce"].status is Status.SKIPPED, what
        assert "label smoothing" in " ".join(report["fused_ce"].reasons)
    # a compute_loss_func receives the full logits
    trainer = sft_trainer(tiny(), tmp_path / "clf", rows, loss_type=loss_type)
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
    reasons = " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)
    assert "compute_loss_func" in reasons
    # a subclass's compute_loss may read the logits
    from trl import SFTTrainer

    class Custom(SFTTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    trainer = sft_trainer(tiny(), tmp_path / "sub", rows, loss_type=loss_type)
    trainer.__class__ = Custom
    assert "overrides compute_loss" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)


def test_declines_quantized_head(tmp_path):
    loss_type, _ = PATHS[0]
    model = tiny()
    rows = greedy_rows(model)
    quantized = copy.deepcopy(model)
    quantized.lm_head.weight = torch.nn.Parameter(
        torch.zeros_like(quantized.lm_head.weight, dtype=torch.int8), requires_grad=False
    )
    trainer = sft_trainer(quantized, tmp_path / "q", rows, loss_type=loss_type)
    assert "quantized" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)


def test_declines_lora_on_head(tmp_path):
    loss_type, _ = PATHS[0]
    rows = greedy_rows()
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"], lora_dropout=0.0))
    try:
        trainer = sft_trainer(peft_model, tmp_path / "l", rows, loss_type=loss_type)
    except ValueError as error:  # TRL's own fused paths refuse it first
        assert "lm_head" in str(error)
        return
    assert "lm_head" in " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)


@pytest.mark.skipif(has_fused_head(), reason="TRL >= 1.15 keeps its own head under use_liger_kernel")
def test_declines_liger(tmp_path):
    """use_liger_kernel=True on TRL <= 1.14: Liger's fused linear cross-entropy computes the loss (set after the
    trainer is built: the floor sets do not install liger-kernel, which TRL imports at construction)."""
    trainer = sft_trainer(tiny(), tmp_path, greedy_rows(tiny()), loss_type="nll")
    trainer.args.use_liger_kernel = True
    reasons = " ".join(leantrain.patch_trainer(trainer, **OFF)["fused_ce"].reasons)
    assert "use_liger_kernel" in reasons


@pytest.mark.parametrize(("loss_type", "path"), PATHS)
def test_stock_loss_by_default_where_not_measured_faster(tmp_path, monkeypatch, loss_type, path):
    """The auto rule on every SFT path this TRL takes: without a cell at this head on this device class the stock
    loss serves (the reason names the loss it keeps); asked for, leantrain's op serves the path anyway; a cell
    measured faster here applies it in auto mode."""
    trainer = sft_trainer(tiny(), tmp_path, greedy_rows(tiny()), loss_type=loss_type)
    outcome = leantrain.patch_trainer(trainer, **OFF)["fused_ce"]
    assert outcome.status is Status.SKIPPED and not outcome.targets
    kept = {"trl_fused": "TRL's own fused LM head", "chunked_nll": "TRL's chunked cross-entropy"}
    assert outcome.reasons[0].startswith("not measured ")
    assert f"the stock loss ({kept.get(path, 'the full-logits loss')}); pass fused_ce=True" in outcome.reasons[0]
    # asked for explicitly, leantrain's op serves the path whatever the rule says
    trainer = sft_trainer(tiny(), tmp_path / "forced", greedy_rows(), loss_type=loss_type)
    forced = leantrain.patch_trainer(trainer, fused_ce=True, **OFF)["fused_ce"]
    assert forced.status is Status.APPLIED and "applied on request (fused_ce=True)" in forced.detail
    _, _, report = pair(tmp_path / "measured", tiny(), loss_type, patch=OFF, measured=monkeypatch)
    assert_served(report, path)
    assert (
        "applied on request" not in report["fused_ce"].detail and str(dispatch.EVIDENCE) in report["fused_ce"].detail
    )


# ------------------------------------------------------------------------------------- fallbacks and undo
def test_forced_probe_failure_runs_stock(tmp_path, monkeypatch):
    import leantrain.fused_ce.probe as probe_module

    monkeypatch.setattr(probe_module, "model_reasons", lambda model, path: ["forced for the test"])
    loss_type, _ = PATHS[0]
    with pytest.raises(leantrain.NotReadyError, match="fused_ce is required but not ready: forced for the test"):
        pair(tmp_path / "asked", tiny(), loss_type)
    # auto mode where the op measured faster: the blocker is the reason
    patched, stock, report = pair(tmp_path, tiny(), loss_type, patch=OFF, measured=monkeypatch)
    outcome = report["fused_ce"]
    assert outcome.status is Status.SKIPPED and outcome.reasons == ("forced for the test",)
    ours, ref = run_pair(patched, stock, 1)
    assert torch.equal(ours["losses"], ref["losses"])  # the stock path ran: bitwise
    assert all(torch.equal(ours["grads"][n], ref["grads"][n]) for n in ref["grads"])


@pytest.mark.expect_fallback
def test_runtime_fallback(tmp_path, monkeypatch):
    loss_type, _ = PATHS[0]
    patched, stock, report = pair(tmp_path, tiny(), loss_type)
    assert report["fused_ce"].status is Status.APPLIED

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    spy_op(monkeypatch, boom)
    batches = batches_of(stock, 2)
    with pytest.warns(RuntimeWarning, match="fused_ce failed at run time"):
        ours = window(patched, batches[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # warned once
        ours_next = window(patched, batches[1:])
    ref = window(stock, batches[:1])
    assert torch.equal(ours["losses"], ref["losses"])
    assert torch.isfinite(ours_next["losses"]).all()
    current = leantrain.current_report(patched)["fused_ce"]
    assert current.status is Status.FAILED and "injected" in current.reasons[0]


def test_patch_unpatch_restores_by_identity(tmp_path):
    loss_type, _ = PATHS[0]
    trainer = sft_trainer(tiny(), tmp_path, greedy_rows(tiny()), loss_type=loss_type)
    base = trainer.model
    before = {"forward": base.__dict__.get("forward"), "compute_loss": trainer.__dict__.get("compute_loss")}
    report = leantrain.patch_trainer(trainer, **ON)
    assert report["fused_ce"].status is Status.APPLIED
    assert base.__dict__.get("forward") is not before["forward"]
    print(base)
    leantrain.unpatch_trainer(trainer)
    assert base.__dict__.get("forward") is before["forward"]
    assert trainer.__dict__.get("compute_loss") is before["compute_loss"]


def test_eval_loss_only_is_served(tmp_path, monkeypatch):
    """Evaluation without compute_metrics reads no logits: the fused op serves it, with TRL's eval metrics."""
    loss_type, _ = PATHS[0]
    model = tiny()
    rows = greedy_rows(model)
    patched = sft_trainer(model, tmp_path / "p", rows, loss_type=loss_type)
    stock = sft_trainer(copy.deepcopy(model), tmp_path / "s", rows, loss_type=loss_type)
    leantrain.patch_trainer(patched, **ON)
    calls = spy_op(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched.evaluate(stock.train_dataset)
        stock.evaluate(stock.train_dataset)
    assert calls
    ours, ref = patched.state.log_history[-1], stock.state.log_history[-1]
    for key in ("eval_loss", "eval_entropy"):
        assert ours[key] == pytest.approx(ref[key], rel=FP32), key
    assert ours["eval_mean_token_accuracy"] == ref["eval_mean_token_accuracy"]
