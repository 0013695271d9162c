"""GRPOTrainer end to end: leantrain's fused log-probs vs TRL's stock fused head; probe reasons; runtime fallback;
patch/unpatch identity; the TRL <= 1.14 method path (faked on the 1.16 trainer, real on TRL 0.29 / 1.14)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch


trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import transformers  # noqa: E402

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model, train_tokenizer  # noqa: E402
from leantrain.grpo_logps import GrpoLogps, nograd  # noqa: E402
from leantrain.grpo_logps import probe as logps_probe  # noqa: E402
from leantrain.lm_head import ops  # noqa: E402
from tests._grpo_logps_trainers import (  # noqa: E402
    HAS_FUSED_HEAD,
    assert_bf16_trajectory,
    count_op_calls,
    make_trainer,
    needs_fused_head,
)


METRICS = ("loss", "grad_norm", "kl", "entropy")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama saved to disk: GRPOTrainer builds the beta > 0 reference model from the policy's path."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tok = train_tokenizer()
    tiny_model("llama", seed=0, vocab_size=len(tok), hidden=64, layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def trajectory(trainer, quiet=True):
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        trainer.train()
    return [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h]


def assert_same_trajectory(stock, ours, rel=1e-4, abs_tol=1e-6):
    assert len(stock) == len(ours) == 3
    for a, b in zip(stock, ours):
        assert a.keys() == b.keys()
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=abs_tol), (key, a[key], b[key])


@pytest.mark.slow
@pytest.mark.parametrize(
    "beta, lora, bf16",
    [(0.0, False, False), (0.1, False, False), (0.0, True, False), (0.1, True, False), (0.1, True, True)],
)
def test_trajectory_matches_stock(model_dir, tmp_path, monkeypatch, beta, lora, bf16):
    stock_completions, our_completions, scales = [], [], []
    kwargs = dict(beta=beta, lora=lora, bf16=bf16)
    stock = trajectory(make_trainer(model_dir, tmp_path, record=stock_completions, **kwargs))
    calls = count_op_calls(monkeypatch, scales)
    trainer = make_trainer(model_dir, tmp_path, record=our_completions, **kwargs)
    report = leantrain.patch_trainer(trainer, grpo_logps=True)
    assert report["grpo_logps"].status is leantrain.Status.APPLIED
    path = "TRL >= 1.15" if HAS_FUSED_HEAD else "TRL <= 1.14"
    assert path in report["grpo_logps"].detail and "torch chunked" in report["grpo_logps"].detail
    assert ("ref model" in report["grpo_logps"].detail) == (beta > 0 and not lora)
    ours = trajectory(trainer)
    assert stock_completions == our_completions  # same generations, so the trajectories are comparable
    assert calls, "leantrain's op never ran"
    assert leantrain.current_report(trainer)["grpo_logps"].status is leantrain.Status.APPLIED
    if beta > 0:
        assert ours[-1]["kl"] > 0  # the reference path ran (ref model, or the policy with its adapter disabled)
    if bf16:
        assert_bf16_trajectory(stock, ours, beta, scales)
    else:
        # fp32: the same fp32 GEMM on both sides, the heads differ only in the fp32 summation order of the
        # normalizer (per-token logp ~1e-6 apart, measured per-step values ~1e-6 apart): 1e-4 relative leaves room
        # for 3 optimizer steps at lr 1e-2, and kl (a difference of logps, ~1e-3) gets the absolute 1e-6, which is
        # sqrt(2·kl)·δ with δ ≈ 2e-5 per token, 20x the fp32 normalizer's rounding
        assert_same_trajectory(stock, ours, rel=1e-4, abs_tol=1e-6)


@pytest.mark.expect_fallback
@pytest.mark.slow
def test_runtime_fallback(model_dir, tmp_path, monkeypatch):
    stock = trajectory(make_trainer(model_dir, tmp_path, bf16=False))
    trainer = make_trainer(model_dir, tmp_path, bf16=False)
    leantrain.patch_trainer(trainer, grpo_logps=True)  # auto mode keeps TRL's log-probs on a CPU (not measured)

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(ops, "logp_entropy", broken)
    with pytest.warns(RuntimeWarning, match="grpo_logps failed at run time") as record:
        ours = trajectory(trainer, quiet=False)
    assert sum("grpo_logps failed" in str(w.message) for w in record) == 1  # warned once
    outcome = leantrain.current_report(trainer)["grpo_logps"]
    assert outcome.status is leantrain.Status.FAILED and "injected" in outcome.reasons[0]
    assert_same_trajectory(stock, ours)  # TRL's own head took over from the first call


@needs_fused_head
def test_patch_unpatch_identity(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, beta=0.1)
    policy, ref = trainer.model, trainer.ref_model
    before = (policy.__dict__["forward"], ref.__dict__["forward"], policy.forward, ref.forward)
    report = leantrain.patch_trainer(trainer, grpo_logps=True)
    assert report["grpo_logps"].status is leantrain.Status.APPLIED
    assert policy.__dict__["forward"] is not before[0] and ref.__dict__["forward"] is not before[1]
    assert policy.forward.__leantrain_original__ is before[0]
    leantrain.unpatch_trainer(trainer)
    assert policy.__dict__["forward"] is before[0] and ref.__dict__["forward"] is before[1]


def test_apply_takes_the_plan_and_reads_nothing_again(model_dir, tmp_path, monkeypatch):
    """Everything apply needs is in the probe's plan: with every probe function broken after the probe, apply installs
    the same wrappers and reports the probe's detail (TRL's fused path here; the legacy method on TRL <= 1.14)."""
    import inspect

    from leantrain.fallback import RuntimeFallback
    from leantrain.optimization import PatchContext

    trainer = make_trainer(model_dir, tmp_path, beta=0.1, bf16=False)
    cfg = leantrain.config.resolve_config({}, environ={})
    ctx = PatchContext(cfg, "grpo", RuntimeFallback("grpo_logps", strict=False))
    ready = GrpoLogps().probe(trainer, ctx)
    assert not ready.blocked, ready.reasons
    for name, fn in inspect.getmembers(logps_probe, inspect.isfunction):
        if fn.__module__ == logps_probe.__name__:
            monkeypatch.setattr(logps_probe, name, _raise_injected)
    applied = GrpoLogps().apply(trainer, ready.plan, ctx)
    assert applied.detail == ready.detail
    fused = ready.plan.path == "fused"
    assert len(applied.targets) == 2 + (not fused)  # policy and reference forwards (+ the replaced method)
    ids, att, k = legacy_inputs()
    calls = count_op_calls(monkeypatch)
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, k, compute_entropy=True)
    assert calls  # leantrain's op served TRL's own scoring method
    ctx.undo()
    assert not hasattr(trainer.model.forward, "__leantrain_original__")


@needs_fused_head
def test_fused_forward_matches_trl_with_all_masked_rows(model_dir, tmp_path):
    """One fused call: same FusedCausalLMOutput fields as TRL's, including an all-masked row and its gradient."""
    trainer = make_trainer(model_dir, tmp_path)
    model = trainer.model
    ids = torch.randint(3, 500, (3, 12))
    att = torch.ones_like(ids)
    att[1, :4] = 0
    labels = ids.masked_fill(att == 0, -100)
    labels[:, :-5] = -100
    labels[2] = -100  # a row with nothing to score
    outs = []
    for patched in (False, True):
        if patched:
            assert leantrain.patch_trainer(trainer, grpo_logps=True)["grpo_logps"].status is leantrain.Status.APPLIED
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=att, labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum() * 0).backward()
        grad = model.model.layers[0].mlp.up_proj.weight.grad.clone()
        outs.append((out, grad))
    (a, ga), (b, gb) = outs
    assert torch.equal(a.label_mask, b.label_mask)
    assert (b.log_probs[2] == 0).all() and (b.log_probs[~b.label_mask] == 0).all()
    torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.entropy, a.entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-7)


@needs_fused_head
def test_keep_logits_option_reaches_the_op(model_dir, tmp_path, monkeypatch):
    """grpo_logps_keep_logits_mib: checked at patch time, then the policy's trainable head keeps its logits for the
    backward (same gradient as the recompute, bitwise on CPU)."""
    trainer = make_trainer(model_dir, tmp_path)
    model = trainer.model
    monkeypatch.setenv("LEANTRAIN_GRPO_LOGPS_KEEP_LOGITS_MIB", "-1")
    with pytest.raises(ValueError, match="LEANTRAIN_GRPO_LOGPS_KEEP_LOGITS_MIB must be >= 0"):
        leantrain.patch_trainer(trainer)
    monkeypatch.delenv("LEANTRAIN_GRPO_LOGPS_KEEP_LOGITS_MIB")
    kept: list[bool] = []
    real = ops.LogpEntropyFunction.forward

    def spy(ctx, *args):
        out = real(ctx, *args)
        kept.append(ctx.kept_logits is not None)
        return out

    monkeypatch.setattr(ops.LogpEntropyFunction, "forward", staticmethod(spy))
    ids = torch.randint(3, 500, (2, 10))
    labels = ids.masked_fill(torch.arange(10) < 4, -100)
    grads = []
    for keep_mib in (0, 64):
        with leantrain.patched(trainer, grpo_logps=True, grpo_logps_keep_logits_mib=keep_mib):
            model.zero_grad()
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            (out.log_probs.sum() + out.entropy.sum()).backward()
        grads.append((model.lm_head.weight.grad.clone(), model.model.layers[0].mlp.up_proj.weight.grad.clone()))
    assert kept == [False, True]
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_probe_reasons(model_dir, tmp_path):
    opt = GrpoLogps()
    cfg = leantrain.config.resolve_config({}, environ={})
    trainer = make_trainer(model_dir, tmp_path)
    ready = opt.probe(trainer, cfg)
    assert not ready.blocked and "kernel: torch chunked" in ready.detail

    head = trainer.model.lm_head
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    assert any("bias" in r for r in opt.probe(trainer, cfg).reasons)
    head.bias = None
    if not HAS_FUSED_HEAD:  # the rest reads TRL's fused-head closure
        return

    trainer.model.config.logit_scale = 2.0  # set after TRL read the config: scaling no longer known
    assert any("unknown output scaling" in r for r in opt.probe(trainer, cfg).reasons)
    del trainer.model.config.logit_scale

    fused = trainer.model.__dict__.pop("forward")  # TRL's fused head missing while TRL has add_fused_lm_head
    reasons = opt.probe(trainer, cfg).reasons
    assert reasons and "TRL not recognised" in reasons[0]
    trainer.model.forward = fused


def test_probe_declines_lm_head_lora(model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    trainer = make_trainer(model_dir, tmp_path, lora=True)
    # TRL refuses LoRA on lm_head at construction; simulate a model whose head got an adapter afterwards
    peft_model = get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=2, target_modules=["lm_head"])
    )
    reasons = logps_probe.head_reasons(peft_model.get_base_model())
    assert any("PEFT adapter" in r for r in reasons)
    assert not GrpoLogps().probe(trainer, leantrain.config.resolve_config({}, environ={})).blocked


@needs_fused_head
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fused_forward_moe_aux_loss_matches_trl(tmp_path, family):
    """An MoE policy asked for router logits: the same aux loss and total loss as TRL's own fused head (the expert
    counts and the coefficient read as TRL reads them on this transformers), with its gradient."""
    path = tmp_path / family
    tok = train_tokenizer()
    model = tiny_model(family, seed=0, vocab_size=len(tok), hidden=64, layers=2)
    model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.02
    model.save_pretrained(path)
    tok.save_pretrained(path)
    trainer = make_trainer(str(path), tmp_path)
    model = trainer.model
    ids = torch.randint(3, 500, (2, 10))
    att = torch.ones_like(ids)
    att[1, :3] = 0
    labels = ids.masked_fill(att == 0, -100)
    outs = []
    for patched in (False, True):
        if patched:
            assert "grpo_logps" in leantrain.patch_trainer(trainer, grpo_logps=True).applied
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=att, labels=labels, fused_lm_head=True, output_router_logits=True)
        out.loss.backward()
        router = next(p for n, p in model.named_parameters() if "router" in n or "gate.weight" in n)
        outs.append((out, router.grad.clone()))
    (a, ga), (b, gb) = outs
    assert a.aux_loss is not None and a.aux_loss > 0
    # fp32 throughout: the aux loss comes from the same router logits (exact); the log-prob sum differs by the op's
    # summation order only (a few ulps of values of size ~log V)
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=0, atol=0)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------- TRL <= 1.14 (faked API shape)
def old_trl_method(trainer, n_values):
    """TRL 1.7-1.14's full-logits `_get_per_token_logps_and_entropies` (text part), 3-tuple; 0.20-1.6: 2-tuple."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def method(
        model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, pixel_values=None, image_grid_thw=None,
    ):  # fmt: skip
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits
        logits = logits[:, :-1][:, -logits_to_keep:] / trainer.temperature
        logps = selective_log_softmax(logits, input_ids[:, -logits_to_keep:])
        entropies = entropy_from_logits(logits) if compute_entropy else None
        return (logps, entropies) if n_values == 2 else (logps, entropies, None)

    return method


@pytest.mark.expect_fallback
@needs_fused_head
@pytest.mark.parametrize("n_values", [2, 3])
def test_legacy_trl_method(model_dir, tmp_path, monkeypatch, n_values):
    trainer = make_trainer(model_dir, tmp_path, bf16=False)  # fp32 end to end: the full-logits path is exact
    base = trainer.model
    base.__dict__.pop("forward")  # no fused head: the pre-1.15 model
    assert trl.RLOOTrainer  # import TRL's lazy modules while add_fused_lm_head still exists
    monkeypatch.delattr("trl.trainer.utils.add_fused_lm_head")
    old = old_trl_method(trainer, n_values)
    if n_values == 3:
        method = old
    else:

        def method(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False):
            return old(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy)

    trainer._get_per_token_logps_and_entropies = method
    opt = GrpoLogps()
    ready = opt.probe(trainer, leantrain.config.resolve_config({}, environ={}))
    assert not ready.blocked and f"TRL <= 1.14 _get_per_token_logps_and_entropies ({n_values}-tuple)" in ready.detail
    assert ready.plan.legacy == logps_probe.LegacyMethod("_get_per_token_logps_and_entropies", n_values)
    assert not ready.plan.guards_forwards  # the fallback sits around the replaced method

    ids, att, k = legacy_inputs()
    stock = method(base, ids, att, k, compute_entropy=True)
    patch_trainer_calls = count_op_calls(monkeypatch)
    report = leantrain.patch_trainer(trainer, grpo_logps=True)
    assert report["grpo_logps"].status is leantrain.Status.APPLIED
    ours = trainer._get_per_token_logps_and_entropies(base, ids, att, k, compute_entropy=True)
    assert len(ours) == n_values and patch_trainer_calls
    keep = att[:, -k:].bool()  # TRL masks padded completion tokens in the loss; ours are exactly 0 there
    torch.testing.assert_close(ours[0][keep], stock[0][keep], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1][keep], stock[1][keep], rtol=0, atol=1e-5)
    assert (ours[0][~keep] == 0).all()
    # The reference model's calls ask for no entropy.
    no_entropy = trainer._get_per_token_logps_and_entropies(base, ids, att, k)
    assert no_entropy[1] is None
    torch.testing.assert_close(no_entropy[0], ours[0], rtol=0, atol=1e-6)  # same op, entropy terms skipped
    assert_no_grad_dispatch_is_off(trainer, base, monkeypatch, patch_trainer_calls)
    # A failure inside the fused path falls back to the stock method (full logits), once, for good.
    monkeypatch.setattr(ops, "logp_entropy", _raise_injected)
    with pytest.warns(RuntimeWarning, match="grpo_logps failed at run time"):
        fallen = trainer._get_per_token_logps_and_entropies(base, ids, att, k, compute_entropy=True)
    torch.testing.assert_close(fallen[0], stock[0], rtol=0, atol=0)
    assert leantrain.current_report(trainer)["grpo_logps"].status is leantrain.Status.FAILED
    leantrain.unpatch_trainer(trainer)
    assert trainer._get_per_token_logps_and_entropies is method and "forward" not in base.__dict__


def assert_no_grad_dispatch_is_off(trainer, base, monkeypatch, calls) -> None:
    """On this path the forward under the wrapper is the model's own (full logits), not TRL's fused head: no-grad
    calls run leantrain's op even where the rule would send them to TRL's head."""
    before = len(calls)
    ids, att, k = legacy_inputs()
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(nograd, "trl_head_serves", lambda *args: True)
        trainer._get_per_token_logps_and_entropies(base, ids, att, k)
    assert len(calls) == before + 1


def legacy_inputs() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids [4, 14], attention mask with a padded completion tail, logits_to_keep) for the legacy methods."""
    ids = torch.randint(3, 500, (4, 14))
    att = torch.ones_like(ids)
    att[0, -3:] = 0  # padded completion tail
    return ids, att, 6


def _raise_injected(*args, **kwargs):
    raise RuntimeError("injected failure")


@pytest.mark.expect_fallback
@pytest.mark.skipif(HAS_FUSED_HEAD, reason=f"the real TRL <= 1.14 method: installed trl {trl.__version__}")
def test_legacy_real_trl_method(model_dir, tmp_path, monkeypatch):
    """The installed TRL's own full-logits method (0.29: 2 values; GRPO 1.14: ``_full_logits_logps``, 3 values)."""
    trainer = make_trainer(model_dir, tmp_path, bf16=False)  # fp32 end to end: the full-logits path is exact
    base = trainer.model
    name = logps_probe.legacy_method_name(trainer)
    method = getattr(trainer, name)
    ids, att, k = legacy_inputs()
    stock = method(base, ids, att, k, compute_entropy=True)
    calls = count_op_calls(monkeypatch)
    report = leantrain.patch_trainer(trainer, grpo_logps=True)
    assert report["grpo_logps"].status is leantrain.Status.APPLIED, report
    assert f"TRL <= 1.14 {name}" in report["grpo_logps"].detail
    ours = getattr(trainer, name)(base, ids, att, k, compute_entropy=True)
    assert len(ours) == len(stock) and calls
    keep = att[:, -k:].bool()  # TRL masks padded completion tokens in the loss; ours are exactly 0 there
    # fp32 both ways: same math up to summation order over a 2048-word vocabulary (measured ~1e-6)
    torch.testing.assert_close(ours[0][keep], stock[0][keep], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1][keep], stock[1][keep], rtol=0, atol=1e-5)
    assert (ours[0][~keep] == 0).all()
    # The public entry point reaches the replaced method (GRPO 1.14 dispatches to _full_logits_logps).
    via_entry = trainer._get_per_token_logps_and_entropies(base, ids, att, k, compute_entropy=True)
    torch.testing.assert_close(via_entry[0], ours[0], rtol=0, atol=0)
    assert_no_grad_dispatch_is_off(trainer, base, monkeypatch, calls)
    monkeypatch.setattr(ops, "logp_entropy", _raise_injected)
    with pytest.warns(RuntimeWarning, match="grpo_logps failed at run time"):
        fallen = getattr(trainer, name)(base, ids, att, k, compute_entropy=True)
    torch.testing.assert_close(fallen[0], stock[0], rtol=0, atol=0)
    leantrain.unpatch_trainer(trainer)
    assert "forward" not in base.__dict__ and name not in trainer.__dict__

    trainer.use_liger_kernel = True  # this TRL then computes the loss with Liger: nothing for leantrain to replace
    reasons = GrpoLogps().probe(trainer, leantrain.config.resolve_config({}, environ={})).reasons
    assert reasons and "use_liger_kernel=True" in reasons[0] and "trl >= 1.15" in reasons[0]


def test_auto_keeps_trls_log_probs_where_not_measured(model_dir, tmp_path, monkeypatch):
    """The auto rule: the fused log-probs are measured on CUDA only, so on another device class auto mode keeps TRL's
    own log-probs and says so; grpo_logps=True applies them anyway; a device class with a measurement applies them."""
    from leantrain.grpo_logps import measured

    assert measured.device_reason("cuda") is None
    trainer = make_trainer(model_dir, tmp_path)
    device = trainer.args.device.type
    monkeypatch.setattr(measured, "MEASURED_ON", ("cuda",))
    outcome = leantrain.patch_trainer(trainer)["grpo_logps"]
    if device == "cuda":  # measured here: auto mode applies them
        assert outcome.status is leantrain.Status.APPLIED
        return
    assert outcome.status is leantrain.Status.SKIPPED and not outcome.targets
    assert outcome.reasons == (
        f"not measured on {device} (measured on cuda only: {measured.EVIDENCE}): TRL's own log-probs; pass "
        "grpo_logps=True to apply anyway",
    )
    leantrain.unpatch_trainer(trainer)
    asked = leantrain.patch_trainer(trainer, grpo_logps=True)["grpo_logps"]
    assert asked.status is leantrain.Status.APPLIED
    assert f"applied on request (grpo_logps=True); not measured on {device}" in asked.detail
    leantrain.unpatch_trainer(trainer)
    monkeypatch.setattr(measured, "MEASURED_ON", ("cuda", device))
    assert leantrain.patch_trainer(trainer)["grpo_logps"].status is leantrain.Status.APPLIED
    leantrain.unpatch_trainer(trainer)
