"""No-grad calls (old / reference log-probs) go to TRL's own fused head where it measured faster.

The rule (``nograd.py``: TRL's head on TRL's fused path, within reach of the measured vocabularies, on Triton; its
constants are checked against the measurements in tests/unit/test_bench_grpo_logps.py); the dispatch in the patched
GRPOTrainer's forward (TRL >= 1.15): TRL's forward bitwise when dispatched (it is TRL's forward), leantrain's op
otherwise and whenever a gradient is wanted; the report names the dispatch."""

from __future__ import annotations

import pytest
import torch


trl = pytest.importorskip("trl")

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model, train_tokenizer  # noqa: E402
from leantrain.grpo_logps import nograd  # noqa: E402
from leantrain.grpo_logps import patch as glue  # noqa: E402
from leantrain.grpo_logps import probe as logps_probe  # noqa: E402
from leantrain.lm_head import ops  # noqa: E402
from tests._grpo_logps_trainers import count_op_calls, make_trainer, needs_fused_head  # noqa: E402


# ------------------------------------------------------------------------------------------------------ the rule
def test_a_tie_within_the_noise_goes_to_the_stock_head():
    assert nograd.trl_head_wins(1.0, 1 - nograd.NOISE / 2)
    assert not nograd.trl_head_wins(1.0, 1 - 2 * nograd.NOISE)


def test_rule_reach_and_backend():
    """TRL's head within V_REACH of the measured vocabularies on Triton (the only backend measured), nowhere else."""
    low, high = (int(nograd.MEASURED_V[0] / nograd.V_REACH), int(nograd.MEASURED_V[1] * nograd.V_REACH))
    assert nograd.trl_head_serves(low, "triton") and nograd.trl_head_serves(high, "triton")
    assert not nograd.trl_head_serves(low - 1, "triton") and not nograd.trl_head_serves(high + 1, "triton")
    assert not nograd.trl_head_serves(nograd.MEASURED_V[0], "torch")


def fused_call(model, trl_head: bool) -> glue.FusedCall:
    st = glue.HeadSettings(1.0, logps_probe.FUSED_OUTPUTS, False, 1.0, None, "base_model", model.config)
    return glue.FusedCall(st, run_op=None, entropy_grad=lambda: False, trl_head=trl_head)


def test_dispatch_only_without_gradient(monkeypatch):
    monkeypatch.setattr(nograd, "trl_head_serves", lambda *args: True)
    model = tiny_model("llama", vocab_size=64, hidden=32, layers=1)
    call = fused_call(model, trl_head=True)
    assert not glue.uses_trl_head(model, call)
    with torch.no_grad():
        assert glue.uses_trl_head(model, call)
    with torch.inference_mode():
        assert glue.uses_trl_head(model, call)


def test_never_dispatches_below_a_forward_that_is_not_trl_fused_head(monkeypatch):
    """TRL <= 1.14: the wrapped forward's original is the model's own (full logits), not a head the rule measured."""
    monkeypatch.setattr(nograd, "trl_head_serves", lambda *args: True)
    model = tiny_model("llama", vocab_size=64, hidden=32, layers=1)
    with torch.no_grad():
        assert not glue.uses_trl_head(model, fused_call(model, trl_head=False))


# --------------------------------------------------------------------------------------------- the trainer's path
def patch(trainer) -> leantrain.PatchReport:
    """The fused log-probs requested (auto mode keeps TRL's on a CPU, where nothing is measured), and applied."""
    report = leantrain.patch_trainer(trainer, grpo_logps=True)
    assert report["grpo_logps"].status is leantrain.Status.APPLIED, report["grpo_logps"].reasons
    return report


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_nograd")
    tok = train_tokenizer()
    tiny_model("llama", seed=0, vocab_size=len(tok), hidden=64, layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def batch(valid: int = 5):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (3, 12), generator=g)
    att = torch.ones_like(ids)
    att[1, :4] = 0
    labels = ids.masked_fill(att == 0, -100)
    labels[:, :-valid] = -100
    return dict(input_ids=ids, attention_mask=att, labels=labels, fused_lm_head=True)


def outputs(trainer, no_grad=True, **kw):
    """(policy output, reference output) of one fused call each. The trainers here run fp32 (bf16=False): with bf16,
    accelerate wraps the reference model's forward in its own autocast, which TRL's calls also enter from outside
    (``accelerator.autocast()``), and these direct calls would not."""
    ctx = torch.no_grad() if no_grad else torch.enable_grad()
    with ctx:
        return trainer.model(**batch(**kw)), trainer.ref_model(**batch(**kw))


def assert_equal_outputs(a, b) -> None:
    for field in ("log_probs", "entropy", "loss", "label_mask"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None and y is None) or torch.equal(x, y), field


@needs_fused_head
@pytest.mark.parametrize("bf16", [False, True])
def test_dispatched_no_grad_call_is_trls_forward_bitwise(model_dir, tmp_path, monkeypatch, bf16):
    """With bf16, accelerate wraps the prepared reference model's forward (autocast, fp32 outputs): TRL's fused forward
    is found under those wrappers and the whole wrapped forward serves the call."""
    trainer = make_trainer(model_dir, tmp_path, beta=0.1, bf16=bf16)  # beta > 0: a reference model too
    stock = outputs(trainer)
    patch(trainer)
    calls = count_op_calls(monkeypatch)
    monkeypatch.setattr(nograd, "trl_head_serves", lambda *args: True)
    ours = outputs(trainer)
    assert calls == []  # leantrain's op never ran
    for a, b in zip(stock, ours):
        assert_equal_outputs(a, b)
    assert ours[1].entropy is None  # the reference head computes log-probs only, as TRL's
    with torch.inference_mode():
        trainer.model(**batch())
    assert calls == []


@needs_fused_head
def test_fused_op_where_the_rule_says_so_and_whenever_grad_is_on(model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(model_dir, tmp_path, beta=0.1, bf16=False)
    stock = outputs(trainer)
    patch(trainer)
    calls = count_op_calls(monkeypatch)
    monkeypatch.setattr(nograd, "trl_head_serves", lambda *args: False)
    ours = outputs(trainer)
    assert len(calls) == 2  # policy and reference: leantrain's op
    for a, b in zip(stock, ours):
        torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=1e-5)  # as the fused-forward parity test
    monkeypatch.setattr(nograd, "trl_head_serves", lambda *args: True)
    out, _ = outputs(trainer, no_grad=False)  # a gradient is wanted: the gradient path is unchanged
    assert len(calls) == 4 and out.log_probs.requires_grad
    out.log_probs.sum().backward()
    assert trainer.model.model.layers[0].mlp.up_proj.weight.grad is not None


@needs_fused_head
def test_rule_sees_the_heads_vocabulary_and_backend(model_dir, tmp_path, monkeypatch):
    """The real rule through the wrapped forward (its backend forced to the measured one): V is the head's, the
    backend the op's on this device; nothing else (no label count: no host sync)."""
    trainer = make_trainer(model_dir, tmp_path, beta=0.1, bf16=False)
    patch(trainer)
    v, _ = trainer.model.lm_head.weight.shape
    seen = []
    real = nograd.trl_head_serves

    def spy(v_, backend):
        seen.append((v_, backend))
        return real(v_, "triton")

    monkeypatch.setattr(nograd, "trl_head_serves", spy)
    calls = count_op_calls(monkeypatch)
    monkeypatch.setattr(nograd, "MEASURED_V", (v, v))
    outputs(trainer)
    assert calls == []  # a measured vocabulary: TRL's head for the policy and the reference model
    monkeypatch.setattr(nograd, "MEASURED_V", (4 * v, 4 * v))
    outputs(trainer)
    assert len(calls) == 2  # beyond the rule's reach: leantrain's op
    assert seen == [(v, "torch")] * 4


@needs_fused_head
def test_report_names_the_dispatch(model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(model_dir, tmp_path, beta=0.1, bf16=False)
    v, h = trainer.model.lm_head.weight.shape
    heads = [("model", trainer.model), ("ref_model", trainer.ref_model)]
    assert logps_probe.nograd_detail(heads) == ""  # CPU: the rule covers Triton only
    monkeypatch.setattr(ops, "default_backend", lambda device: "triton")
    monkeypatch.setattr(nograd, "MEASURED_V", (v, v))
    detail = logps_probe.nograd_detail(heads)
    report = patch(trainer)
    assert "kernel: torch chunked; " + detail in report["grpo_logps"].detail
    assert detail == (
        f"no-grad calls at policy H={h} V={v} (any N), ref model H={h} V={v} (any N) use TRL's own head "
        f"(measured faster: {nograd.SOURCE})"
    )
