"""CGGR parity on CPU with tiny models: router scores vs the full model's hidden_states[N], patched training steps vs
stock steps on hand-masked labels (plain Trainer and TRL SFTTrainer), gradient accumulation, warmup, eval, PEFT,
gradient checkpointing, fallbacks and undo."""

import copy
import dataclasses
import math
import warnings

import pytest
import torch
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import _compat
from leantrain.cggr import ops as cggr_ops
from leantrain.cggr import patch as cggr_patch
from leantrain.cggr.ops import select_topk
from leantrain.cli.tiny import FAMILIES, tiny_model
from leantrain.models import decoder_parts
from leantrain.report import Status
from testkit.optimizations import others_off


VOCAB = 512
OFF = others_off("cggr")
# transformers >= 5.21 slices logits per row (logits_to_keep), so a plain Trainer's CGGR loss runs the LM head on kept
# rows only; older releases keep stock's loss over masked labels (same math, no head saving; auto mode declines).
ROW_KEEP = _compat.at_least("transformers", _compat.TRANSFORMERS_ROW_LOGITS_TO_KEEP)
PLAIN_PATH = "kept rows only" if ROW_KEEP else "stock loss over masked labels"


def tiny(family="llama", layers=4, vocab_size=VOCAB):
    """A tiny model without dropout (GPT-2 defaults to 0.1), so train-mode forwards are reproducible."""
    drop = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if family == "gpt2" else {}
    return tiny_model(family, vocab_size=vocab_size, hidden=64, layers=layers, **drop)


def make_batch(rows=4, width=12, seed=0, vocab=VOCAB):
    """Right-padded rows of different lengths, with -100 on padding and on a short 'prompt' of each row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, width), generator=g)
    lengths = torch.tensor([width, width - 3, width - 5, 4, width - 1, 6][:rows])
    attention_mask = (torch.arange(width) < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :2] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def trainer_for(model, tmp_path, kind="trainer", **args):
    defaults = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3)
    defaults.update(args)
    if kind == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from leantrain.cli.tiny import train_tokenizer

        g = torch.Generator().manual_seed(1)
        data = Dataset.from_list(
            [{"input_ids": torch.randint(3, VOCAB, (int(n),), generator=g).tolist()} for n in (9, 12, 7, 11, 12, 8)]
        )
        defaults.setdefault("gradient_checkpointing", False)
        return SFTTrainer(
            model=model, args=SFTConfig(**defaults), train_dataset=data, processing_class=train_tokenizer()
        )
    data = [{k: v[i] for k, v in make_batch(6, 12, seed=5).items()} for i in range(6)]
    return Trainer(model=model, args=TrainingArguments(**defaults), train_dataset=data, eval_dataset=data)


def reference_masked(model, batch, ratio, scoring="entropy", layers=2):
    """Labels masked by hand from the full model's hidden_states[k] (no hook involved); ``layers`` as the option
    (negative from the top). transformers' last hidden state already went through the final norm (checked bitwise
    for every tiny family), so at the top the reference scores it without a second norm."""
    parts = decoder_parts(model)
    k = layers if layers > 0 else parts.num_layers + 1 + layers
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    if k == parts.num_layers:
        parts = dataclasses.replace(parts, final_norm=None)
    targets = batch["labels"][:, 1:]
    scores = cggr_ops.score_tokens(parts, out.hidden_states[k], targets, scoring)
    keep = select_topk(scores, targets != -100, None, ratio)
    labels = batch["labels"].clone()
    labels[:, 1:][~keep] = -100
    return {**batch, "labels": labels}, scores


def step(trainer, batches):
    """One accumulation window through the trainer's own counting and training_step; returns (losses, count)."""
    samples, count = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)
    losses = [trainer.training_step(trainer.model, b, count) for b in samples]
    return losses, count


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a, b, rtol, atol):
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def patched_pair(tmp_path, family="llama", kind="trainer", ratio=0.5, layers=4, **opts):
    model = tiny(family, layers).train()
    stock_model = copy.deepcopy(model)
    patched = trainer_for(model, tmp_path / "p", kind)
    stock = trainer_for(stock_model, tmp_path / "s", kind)
    opts = {"cggr_min_tokens_ratio": ratio, "cggr_warmup_steps": 0, **opts}
    report = leantrain.patch_trainer(patched, cggr=True, **OFF, **opts)
    return patched, stock, report


# ---- scores: the in-forward router equals scoring the full model's hidden_states[N] -------------------------------


def capture_scores(monkeypatch):
    seen = []
    real = cggr_patch.select_topk

    def spy(scores, valid, groups, ratio):
        seen.append(scores.clone())
        return real(scores, valid, groups, ratio)

    monkeypatch.setattr(cggr_patch, "select_topk", spy)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_router_scores_equal_full_model_hidden_states(family, tmp_path, monkeypatch):
    seen = capture_scores(monkeypatch)
    patched, stock, _ = patched_pair(tmp_path, family)
    batch = make_batch()
    masked, ref_scores = reference_masked(stock.model.train(), batch, 0.5)
    losses, _ = step(patched, [batch])
    assert len(seen) == 1
    assert torch.equal(seen[0], ref_scores)  # exact: same hidden state, same scoring function
    assert torch.isfinite(losses[0])


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
@pytest.mark.parametrize(("layers", "scoring"), [(3, "entropy"), (-3, "margin"), (-1, "loss"), (4, "combined")])
def test_router_depth_scores_equal_full_model_hidden_states(family, layers, scoring, tmp_path, monkeypatch):
    """Any depth: N after layer N, -k from the top, -1 (and N = layer count) the final hidden state."""
    seen = capture_scores(monkeypatch)
    patched, stock, report = patched_pair(tmp_path, family, cggr_router_layers=layers, cggr_scoring=scoring)
    k = layers if layers > 0 else 5 + layers
    assert f"layer {k} of 4" in report["cggr"].detail
    assert ("final hidden state" in report["cggr"].detail) == (k == 4)
    batch = make_batch()
    _, ref_scores = reference_masked(stock.model.train(), batch, 0.5, scoring, layers)
    step(patched, [batch])
    assert torch.equal(seen[0], ref_scores)


def test_final_hidden_state_loss_scoring_is_the_models_own_token_loss(tmp_path, monkeypatch):
    """Router depth -1 with ``loss``: hard-token mining on the model's own per-token cross-entropy."""
    seen = capture_scores(monkeypatch)
    patched, stock, _ = patched_pair(tmp_path, "gemma2", cggr_router_layers=-1, cggr_scoring="loss")
    batch = make_batch()
    with torch.no_grad():
        logits = stock.model.train()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    valid = targets != -100
    want = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, ignore_index=-100, reduction="none"
    )
    step(patched, [batch])
    # Same logits up to the head GEMM's row blocking (all rows vs valid rows) and the order of the fp32
    # log-sum-exp: a few ulps of values ~log(V) = 6.2 plus the softcapped logits (<= 30).
    tol = 64 * torch.finfo(torch.float32).eps * (math.log(VOCAB) + 30.0)
    torch.testing.assert_close(seen[0][valid], want[valid], rtol=0, atol=tol)


@pytest.mark.parametrize("scoring", ["margin", "loss", "combined"])
def test_other_scorings_equal_full_model_hidden_states(scoring, tmp_path, monkeypatch):
    seen = capture_scores(monkeypatch)
    patched, stock, _ = patched_pair(tmp_path, "gemma2", cggr_scoring=scoring)
    batch = make_batch()
    _, ref_scores = reference_masked(stock.model.train(), batch, 0.5, scoring)
    step(patched, [batch])
    assert torch.equal(seen[0], ref_scores)


@pytest.mark.parametrize("scoring", ["entropy", "margin", "loss", "combined"])
def test_scores_match_full_logits_reference(scoring):
    """The chunked / fused scorers against scores computed from full fp32 logits (softcap model: gemma2)."""
    model = tiny("gemma2", 3)
    parts = decoder_parts(model)
    with torch.no_grad():  # peaky distributions: z-scores of near-constant entropies would amplify rounding
        parts.lm_head.weight.mul_(40)
    batch = make_batch()
    with torch.no_grad():
        hidden = model(**{k: batch[k] for k in ("input_ids", "attention_mask")}, output_hidden_states=True)
        hidden = hidden.hidden_states[2]
        z = parts.lm_head(parts.final_norm(hidden)).float()[:, :-1]
        z = torch.tanh(z / parts.softcap) * parts.softcap
        logp = torch.log_softmax(z, -1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1)
        targets = batch["labels"][:, 1:]
        loss = -logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        top2 = p.topk(2, -1).values
        margin = top2[..., 0] - top2[..., 1]
        valid = targets != -100

        def z_row(x):
            n = valid.sum(1, keepdim=True)
            mean = (x * valid).sum(1, keepdim=True) / n
            std = (((x - mean) ** 2 * valid).sum(1, keepdim=True) / n).sqrt()
            return (x - mean) / std

        want = {"entropy": entropy, "loss": loss, "margin": -margin, "combined": z_row(entropy) - z_row(margin)}
        got = cggr_ops.score_tokens(parts, hidden, targets, scoring, chunk_tokens=5)
    # fp32 reductions in a different order (chunked / online logsumexp): a few ulps of values of size ~6. The
    # combined score divides those ~1e-6 differences by each row's std of entropy/margin (~0.05 here): 1e-4.
    tol = 1e-4 if scoring == "combined" else 1e-5
    torch.testing.assert_close(got[valid], want[scoring][valid], rtol=tol, atol=tol)


def previous_scores(parts, hidden, targets, scoring):
    """The scorer before valid-only scoring (kept here as the reference): every position, full-vocabulary torch
    chunks in fp32 for every scoring (the fused kernel, which the valid-only scorer uses for entropy/loss, is not in
    this path; TRL's chunked kernel was used here before, but older TRL releases have none)."""
    rows, width = targets.shape
    valid = targets != -100
    flat = hidden[:, :width].reshape(rows * width, -1)
    flat_targets = targets.clamp(min=0).reshape(-1)
    out = cggr_ops._chunk_scores(parts, flat, flat_targets, scoring)
    if scoring != "combined":
        return out.view(rows, width)
    out = out.view(rows, width, 2)
    return cggr_ops._zscore(out[..., 0], valid) - cggr_ops._zscore(out[..., 1], valid)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("scoring", ["entropy", "margin", "loss", "combined"])
def test_valid_only_scoring_equals_previous_scoring(family, scoring):
    """Scores of valid positions only, through grpo_logps' fused kernel (entropy/loss), against the previous
    all-positions scorer: same values within fp32 rounding, and the same kept labels where scores are not tied."""
    model = tiny(family, 3, vocab_size=1000)
    parts = decoder_parts(model)
    with torch.no_grad():
        parts.lm_head.weight.mul_(20)  # peaky distributions, so margins and entropies spread out
    batch = make_batch(rows=5, width=23, seed=3, vocab=1000)
    with torch.no_grad():
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
        hidden = hidden.hidden_states[2]
        zmax = parts.lm_head(parts.final_norm(hidden)).abs().max().item()
    targets = batch["labels"][:, 1:]
    valid = targets != -100
    old = previous_scores(parts, hidden, targets, scoring)
    new = cggr_ops.score_tokens(parts, hidden, targets, scoring, n_valid=int(valid.sum()))
    assert torch.equal(new[~valid], torch.zeros_like(new[~valid]))  # padding / prompt: never scored
    # Both are fp32 statistics of the same logits: the GEMMs differ in row blocking (a few ulps of |z| <= zmax) and
    # the log-sum-exp / entropy reductions in order over V terms (a few ulps of log V each).
    eps = torch.finfo(torch.float32).eps
    tol = 16 * eps * (math.log(1000) + min(zmax, parts.softcap or zmax))
    if scoring == "combined":  # z-scores divide by each row's std of entropy and of margin
        with torch.no_grad():
            raw = cggr_ops.score_rows(parts, hidden[:, :-1].reshape(-1, 64), targets.clamp(min=0).reshape(-1), scoring)
        raw = raw.view(*targets.shape, 2)
        tol = 2 * tol / min(raw[b][valid[b]].std(0).min().item() for b in range(5) if valid[b].sum() > 1)
    torch.testing.assert_close(new[valid], old[valid], rtol=0, atol=tol)
    # Untied rows: the gap between consecutive valid scores exceeds twice the tolerance, so selection must agree
    untied = [b for b in range(targets.shape[0]) if old[b][valid[b]].sort().values.diff().min() > 2 * tol]
    assert len(untied) >= 4  # the case is built so that the comparison below has rows to compare
    for ratio in (0.25, 0.5):
        keep_old = select_topk(old[untied], valid[untied], None, ratio)
        keep_new = select_topk(new[untied], valid[untied], None, ratio)
        assert torch.equal(keep_old, keep_new)


def test_alignment_score_at_t_selects_label_t_plus_1(tmp_path, monkeypatch):
    patched, _, _ = patched_pair(tmp_path, ratio=0.01)
    batch = make_batch(rows=1, width=10)
    batch["labels"] = batch["input_ids"].clone()

    def fake_scores(parts, hidden, targets, scoring, **kwargs):
        scores = torch.zeros(targets.shape)
        scores[0, 4] = 1.0  # hidden position 4 predicts token 5
        return scores

    seen = {}
    real_loss = patched.compute_loss.__leantrain_original__

    def spy(model, inputs, **kw):
        seen["labels"] = inputs["labels"]
        return real_loss(model, inputs, **kw)

    monkeypatch.setattr(cggr_ops, "score_tokens", fake_scores)
    runtime = patched._leantrain_cggr
    runtime.settings.kept_only = False  # exercise the masked-labels path so the loss sees the labels
    patched.compute_loss = runtime.wrap_compute_loss(spy)
    step(patched, [batch])
    kept = (seen["labels"][:, 1:] != -100).nonzero() + torch.tensor([0, 1])  # label 0 is never a causal target
    assert kept.tolist() == [[0, 5]]
    assert torch.equal(batch["labels"], batch["input_ids"])  # the caller's batch is never modified


# ---- end-to-end training steps vs stock on hand-masked labels -----------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_plain_trainer_ratio_half_equals_hand_masked_stock(family, tmp_path):
    patched, stock, report = patched_pair(tmp_path, family)
    assert PLAIN_PATH in report["cggr"].detail
    batch = make_batch()
    masked, _ = reference_masked(stock.model.train(), batch, 0.5)
    (loss_p,), count_p = step(patched, [batch])
    (loss_s,), count_s = step(stock, [masked])
    assert count_p.item() == count_s.item() == (masked["labels"][:, 1:] != -100).sum().item()
    # The kept-row head multiplies fewer rows than the stock full-logits head: fp32 GEMM blocking may differ.
    torch.testing.assert_close(loss_p, loss_s, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads(patched.model), grads(stock.model), rtol=1e-5, atol=1e-7)


def test_sft_ratio_half_equals_hand_masked_stock(tmp_path):
    patched, stock, report = patched_pair(tmp_path, kind="sft")
    assert "TRL fused LM head" in report["cggr"].detail
    batch = make_batch()
    masked, _ = reference_masked(stock.model.train(), batch, 0.5)
    (loss_p,), count_p = step(patched, [batch])
    (loss_s,), count_s = step(stock, [masked])
    assert count_p.item() == count_s.item()
    assert torch.equal(loss_p, loss_s)  # same labels, same TRL loss path: bitwise
    assert_grads_close(grads(patched.model), grads(stock.model), rtol=0, atol=0)
    # TRL's token metrics now cover the kept tokens only: same values as the hand-masked stock run
    assert patched._metrics["train"]["entropy"] == stock._metrics["train"]["entropy"]


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_ratio_one_is_stock_exactly(kind, tmp_path, monkeypatch):
    """Ratio 1.0 (and every warmup step) runs the stock path: bitwise equal losses and gradients. A ratio just
    below 1 runs the whole machinery (hook, selection, loss path) and keeps every label."""
    patched, stock, _ = patched_pair(tmp_path, kind=kind, ratio=1.0)
    batch = make_batch()
    (loss_p,), count_p = step(patched, [batch])
    (loss_s,), count_s = step(stock, [batch])
    assert torch.equal(loss_p, loss_s) and torch.equal(count_p, count_s)
    assert_grads_close(grads(patched.model), grads(stock.model), rtol=0, atol=0)

    patched.model.zero_grad()
    stock.model.zero_grad()
    monkeypatch.setattr(patched._leantrain_cggr, "ratio_now", lambda: 1 - 1e-9)
    calls = []
    real = cggr_ops.score_tokens
    monkeypatch.setattr(cggr_ops, "score_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    (loss_p,), count_p = step(patched, [batch])
    (loss_s,), count_s = step(stock, [batch])
    assert calls == [1] and count_p.item() == count_s.item()
    if kind == "sft":  # labels untouched, TRL loss path unchanged: bitwise
        assert torch.equal(loss_p, loss_s)
        assert_grads_close(grads(patched.model), grads(stock.model), rtol=0, atol=0)
    else:  # kept-row head on the gathered rows vs the full-logits head: fp32 GEMM shapes differ
        torch.testing.assert_close(loss_p, loss_s, rtol=1e-6, atol=1e-6)
        assert_grads_close(grads(patched.model), grads(stock.model), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_gradient_accumulation_two_equals_one_big_batch(kind, tmp_path):
    """CGGR under gradient accumulation 2 gives stock's gradients on the same hand-masked halves, and one big batch's
    wherever stock's accumulation does (TRL 0.29's SFTTrainer normalizes each micro-batch's loss on its own, so
    there even stock's GA 2 differs from the big batch by ~2e-3, and CGGR keeps that behaviour)."""
    model = tiny().train()
    big = trainer_for(copy.deepcopy(model), tmp_path / "big", kind)
    stock = trainer_for(copy.deepcopy(model), tmp_path / "stock", kind, gradient_accumulation_steps=2)
    stock_big = trainer_for(copy.deepcopy(model), tmp_path / "stock_big", kind)
    accum = trainer_for(model, tmp_path / "ga", kind, gradient_accumulation_steps=2)
    for t in (big, accum):
        leantrain.patch_trainer(t, cggr=True, cggr_min_tokens_ratio=0.3, cggr_warmup_steps=0, **OFF)
    batch = make_batch(rows=4)
    masked, _ = reference_masked(stock.model.train(), batch, 0.3)  # per-row selection: halves select the same

    def halves(b):
        return [{k: v[:2] for k, v in b.items()}, {k: v[2:] for k, v in b.items()}]

    _, count_big = step(big, [batch])
    _, count_ga = step(accum, halves(batch))
    _, count_stock = step(stock, halves(masked))
    step(stock_big, [masked])
    assert count_big.item() == count_ga.item() == count_stock.item()
    # Same kept labels; the kept-row head multiplies fewer rows than stock's full-logits head and rows are computed
    # in different batch shapes, so fp32 sums differ in the last bits.
    assert_grads_close(grads(accum.model), grads(stock.model), rtol=1e-5, atol=1e-7)
    assert_grads_close(grads(big.model), grads(stock_big.model), rtol=1e-5, atol=1e-7)
    stock_ga_is_big = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-7)
        for a, b in zip(grads(stock.model).values(), grads(stock_big.model).values(), strict=True)
    )
    assert stock_ga_is_big or (kind == "sft" and not _compat.at_least("trl", "1.14.0"))  # seen: 0.29 only
    if stock_ga_is_big:
        assert_grads_close(grads(big.model), grads(accum.model), rtol=1e-5, atol=1e-7)


def test_peft_lora_model(tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    seen = capture_scores(monkeypatch)
    base = tiny()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    model = get_peft_model(base, lora).train()
    stock_model = copy.deepcopy(model)
    patched = trainer_for(model, tmp_path / "p")
    stock = trainer_for(stock_model, tmp_path / "s")
    leantrain.patch_trainer(patched, cggr=True, cggr_min_tokens_ratio=0.5, cggr_warmup_steps=0, **OFF)
    batch = make_batch()
    masked, ref_scores = reference_masked(stock.model.train(), batch, 0.5)
    (loss_p,), _ = step(patched, [batch])
    (loss_s,), _ = step(stock, [masked])
    assert torch.equal(seen[0], ref_scores)  # the router scored with the active adapters (LoRA on lm_head too)
    torch.testing.assert_close(loss_p, loss_s, rtol=1e-6, atol=1e-6)  # kept-row head GEMM shape, as above
    assert_grads_close(grads(patched.model), grads(stock.model), rtol=1e-5, atol=1e-7)


def test_gradient_checkpointing_scores_once(tmp_path, monkeypatch):
    calls = []
    real = cggr_ops.score_tokens
    monkeypatch.setattr(cggr_ops, "score_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    patched, plain, _ = patched_pair(tmp_path)
    leantrain.patch_trainer(plain, cggr=True, cggr_min_tokens_ratio=0.5, cggr_warmup_steps=0, **OFF)
    enable = getattr(patched.model, "activation_checkpointing_enable", None)  # transformers < 5.23: the old name
    (enable or patched.model.gradient_checkpointing_enable)({"use_reentrant": False})
    assert all(layer.gradient_checkpointing for layer in decoder_parts(patched.model).layers)
    batch = make_batch()
    (loss_gc,), _ = step(patched, [batch])
    assert len(calls) == 1  # the layer re-runs in backward, the slot is already consumed
    (loss_plain,), _ = step(plain, [batch])
    assert torch.equal(loss_gc, loss_plain)  # recompute gives the same forward values on CPU
    assert_grads_close(grads(patched.model), grads(plain.model), rtol=0, atol=0)


# ---- training loop: warmup in optimizer steps, logging, eval never masked -----------------------------------------


def test_warmup_counts_optimizer_steps_and_logs(tmp_path):
    model = tiny()
    trainer = trainer_for(
        model, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3, logging_steps=1
    )
    leantrain.patch_trainer(trainer, cggr=True, cggr_min_tokens_ratio=0.25, cggr_warmup_steps=2, **OFF)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    fractions = [h["cggr/kept_fraction"] for h in logs]
    assert fractions[:2] == [1.0, 1.0]  # 2 optimizer steps = 4 micro-batches of warmup
    assert 0.25 <= fractions[2] < 0.5
    assert logs[2]["cggr/score_ms"] > 0


def test_linear_schedule_ramps(tmp_path):
    model = tiny()
    trainer = trainer_for(model, tmp_path, per_device_train_batch_size=3, max_steps=4, logging_steps=1)
    leantrain.patch_trainer(
        trainer, cggr=True, cggr_min_tokens_ratio=0.2, cggr_warmup_steps=4, cggr_ratio_schedule="linear", **OFF
    )
    trainer.train()
    fractions = [h["cggr/kept_fraction"] for h in trainer.state.log_history if "loss" in h]
    assert fractions[0] == 1.0 and all(a > b for a, b in zip(fractions, fractions[1:]))


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_eval_never_masked(kind, tmp_path):
    patched, stock, _ = patched_pair(tmp_path, kind=kind, ratio=0.25)
    batch = make_batch()
    step(patched, [batch])  # past warmup (0), training active
    for t in (patched, stock):
        t.model.eval()
    loss_p = patched.prediction_step(patched.model, batch, prediction_loss_only=True)[0]
    # the patched model took one training step: compare against the stock model carrying the same weights
    stock.model.load_state_dict(patched.model.state_dict())
    loss_s = stock.prediction_step(stock.model, batch, prediction_loss_only=True)[0]
    assert torch.equal(loss_p, loss_s)


# ---- inputs, probe, fallback, undo --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [
        {"cggr_min_tokens_ratio": 0.0},
        {"cggr_min_tokens_ratio": 1.5},
        {"cggr_scoring": "hardest"},
        {"cggr_router_layers": 0},
        {"cggr_router_layers": 5},  # the model has 4 layers
        {"cggr_router_layers": -5},
        {"cggr_ratio_schedule": "cosine"},
        {"cggr_warmup_steps": -1},
    ],
)
def test_bad_inputs_raise_value_error(opts, tmp_path):
    trainer = trainer_for(tiny(), tmp_path)
    with pytest.raises(ValueError):
        leantrain.patch_trainer(trainer, cggr=True, **OFF, **opts)
    assert "compute_loss" not in trainer.__dict__


@pytest.mark.parametrize("layers", [5, -5])
def test_router_depth_out_of_range_names_the_layer_count(layers, tmp_path):
    with pytest.raises(ValueError, match=f"cggr_router_layers={layers} is outside this model's 4 decoder layers"):
        leantrain.patch_trainer(trainer_for(tiny(), tmp_path), cggr=True, cggr_router_layers=layers, **OFF)
    with pytest.raises(ValueError, match="must be a layer"):
        leantrain.patch_trainer(trainer_for(tiny(), tmp_path / "z"), cggr=True, cggr_router_layers=0, **OFF)


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_off_by_default_and_says_why(kind, tmp_path):
    """patch_trainer with no arguments keeps the training math: CGGR is opt-in, and the report says so."""
    trainer = trainer_for(tiny(vocab_size=2048), tmp_path, kind)
    report = leantrain.patch_trainer(trainer, environ={})
    outcome = report["cggr"]
    assert outcome.status is Status.DISABLED and outcome.source == "default"
    assert outcome.reasons == ("off by default: changes which tokens train; pass True",)
    assert "off by default: changes which tokens train; pass True" in str(report)
    assert not outcome.targets and not hasattr(trainer, "_leantrain_cggr")  # (fused_ce may wrap compute_loss)
    env = leantrain.patch_trainer(trainer_for(tiny(), tmp_path / "env", kind), environ={"LEANTRAIN_CGGR": "1"})
    assert env["cggr"].status is Status.APPLIED and env["cggr"].source == "env"


def test_probe_decisions(tmp_path):
    auto = {"environ": {"LEANTRAIN_CGGR": "auto"}}  # auto is reachable through the environment only
    no_saving = "does not skip masked labels"
    # small LM head (vocab 64 vs hidden 64 x 4 layers): auto declines with the share, True applies anyway
    small_head = tiny(vocab_size=64)
    report = leantrain.patch_trainer(trainer_for(small_head, tmp_path / "a"), **OFF, **auto)
    why = "of per-token matmul work" if ROW_KEEP else no_saving
    assert report["cggr"].status is Status.SKIPPED and why in report["cggr"].reasons[0]
    report = leantrain.patch_trainer(trainer_for(small_head, tmp_path / "b"), cggr=True, **OFF)
    assert report["cggr"].status is Status.APPLIED
    # large head, plain Trainer: the kept-row loss path saves head work, auto applies (older transformers: no
    # kept-row path, auto declines and names the version)
    big_head = tiny(vocab_size=2048)
    report = leantrain.patch_trainer(trainer_for(big_head, tmp_path / "c"), **OFF, **auto)
    if ROW_KEEP:
        assert report["cggr"].status is Status.APPLIED and "kept rows only" in report["cggr"].detail
    else:
        reason = report["cggr"].reasons[0]
        assert report["cggr"].status is Status.SKIPPED and no_saving in reason
        assert f"needs transformers >= {_compat.TRANSFORMERS_ROW_LOGITS_TO_KEEP}" in reason
    # SFT on CPU: TRL's fused head scores every row, so masking saves nothing: auto declines and says why
    report = leantrain.patch_trainer(trainer_for(copy.deepcopy(big_head), tmp_path / "d", "sft"), **OFF, **auto)
    assert report["cggr"].status is Status.SKIPPED and "does not skip masked labels" in report["cggr"].reasons[0]
    # default router_layers (2) on a 1-layer model: auto declines instead of raising
    one = tiny(layers=1)
    report = leantrain.patch_trainer(trainer_for(one, tmp_path / "e"), **OFF, **auto)
    assert report["cggr"].status is Status.SKIPPED and "cggr_router_layers" in report["cggr"].reasons[0]
    # label smoothing needs full logits: reported as the loss path
    report = leantrain.patch_trainer(
        trainer_for(copy.deepcopy(big_head), tmp_path / "f", label_smoothing_factor=0.1), cggr=True, **OFF
    )
    assert "label smoothing" in report["cggr"].detail


@pytest.mark.expect_fallback
def test_runtime_fallback(tmp_path, monkeypatch):
    patched, stock, _ = patched_pair(tmp_path, ratio=0.25)

    def boom(*args, **kwargs):
        raise RuntimeError("injected scorer failure")

    monkeypatch.setattr(cggr_ops, "score_tokens", boom)
    batch = make_batch()
    with pytest.warns(RuntimeWarning, match="injected scorer failure"):
        (loss_p,), _ = step(patched, [batch])
    (loss_s,), _ = step(stock, [batch])
    assert torch.equal(loss_p, loss_s)  # the failed window falls back to the unmasked labels and the stock count
    report = leantrain.entry.current_report(patched)
    assert report["cggr"].status is Status.FAILED and "injected" in report["cggr"].reasons[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        (loss_p,), _ = step(patched, [batch])
    patched.train()  # training goes on
    assert patched.state.global_step > 0


@pytest.mark.expect_fallback
def test_fallback_mid_window_divides_the_rest_by_the_stock_count(tmp_path, monkeypatch):
    """If scoring fails on micro-batch 2 of an accumulation window, that micro-batch is the stock loss over the
    window's full label count, not over the kept count handed out at the window's start."""
    patched, stock, _ = patched_pair(tmp_path, ratio=0.25)
    real, calls = cggr_ops.score_tokens, []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected scorer failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(cggr_ops, "score_tokens", fail_second)
    window = [make_batch(seed=1), make_batch(seed=2)]
    with pytest.warns(RuntimeWarning, match="injected scorer failure"):
        losses_p, count_p = step(patched, window)
    losses_s, count_s = step(stock, window)
    assert count_p < count_s  # the window started masked
    assert torch.equal(losses_p[1], losses_s[1])


def test_patch_unpatch_identity(tmp_path):
    model = tiny()
    trainer = trainer_for(model, tmp_path)
    layer = decoder_parts(model).layers[1]
    before = {name: getattr(trainer, name) for name in ("compute_loss", "get_batch_samples", "log")}
    leantrain.patch_trainer(trainer, cggr=True, **OFF)
    assert trainer.compute_loss.__leantrain_original__ == before["compute_loss"]
    assert len(layer._forward_hooks) == 1
    print(model)
    leantrain.unpatch_trainer(trainer)
    for name, method in before.items():
        assert name not in trainer.__dict__ and getattr(trainer, name) == method
        assert getattr(trainer, name).__func__ is getattr(type(trainer), name)
    assert len(layer._forward_hooks) == 0 and not hasattr(trainer, "_leantrain_cggr")


def test_random_control_keeps_same_count_and_leaves_rng(tmp_path):
    patched, stock, _ = patched_pair(tmp_path, cggr_scoring="random")
    batch = make_batch()
    masked, _ = reference_masked(stock.model.train(), batch, 0.5)
    state = torch.get_rng_state()
    _, count_random = step(patched, [batch])
    _, count_ref = step(stock, [masked])
    assert count_random.item() == count_ref.item()
    assert torch.equal(torch.get_rng_state(), state)  # private generator: dropout streams unchanged


def test_packed_rows_select_per_document(tmp_path):
    """Padding-free rows (position_ids restart per document): kept counts per document, kept-row head by mask."""
    patched, stock, _ = patched_pair(tmp_path, ratio=0.3)
    batch = make_batch(rows=2, width=14)
    position_ids = torch.tensor(
        [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4]]
    )
    labels = batch["input_ids"].masked_fill(position_ids == 0, -100)  # like TRL's padding-free collator
    batch = {"input_ids": batch["input_ids"], "position_ids": position_ids, "labels": labels}
    parts = decoder_parts(stock.model)
    with torch.no_grad():
        hidden = stock.model.train()(
            input_ids=batch["input_ids"], position_ids=position_ids, output_hidden_states=True
        )
    targets = labels[:, 1:]
    scores = cggr_ops.score_tokens(parts, hidden.hidden_states[2], targets, "entropy")
    groups = torch.cumsum(position_ids == 0, dim=1)[:, :-1]
    keep = select_topk(scores, targets != -100, groups, 0.3)
    masked = labels.clone()
    masked[:, 1:][~keep] = -100
    (loss_p,), count_p = step(patched, [batch])
    (loss_s,), count_s = step(stock, [{**batch, "labels": masked}])
    # documents of 3/5/3 and 8/4 valid labels: ceil(0.3 n) = 1+2+1 and 3+2
    assert count_p.item() == count_s.item() == 9
    torch.testing.assert_close(loss_p, loss_s, rtol=1e-6, atol=1e-6)  # kept-row head GEMM shape, as above
    assert_grads_close(grads(patched.model), grads(stock.model), rtol=1e-5, atol=1e-7)
