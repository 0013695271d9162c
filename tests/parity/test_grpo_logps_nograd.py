"""Issue #28: no-grad calls (old / reference log-probs) go to TRL's own fused head where it measured faster.

The rule (``glue.nograd_prefers_stock`` over ``glue.NOGRAD_MEASURED``) on synthetic tables; the dispatch in the
patched GRPOTrainer's forward (TRL >= 1.15): TRL's forward bitwise when dispatched (it is TRL's forward), leantrain's
op otherwise and whenever a gradient is wanted; the report names the dispatch."""

from __future__ import annotations

import pytest
import torch


trl = pytest.importorskip("trl")

import leantrain  # noqa: E402
from leantrain.grpo_logps import patch as glue  # noqa: E402
from leantrain.lm_head import ops  # noqa: E402
from leantrain.tiny import tiny_model, train_tokenizer  # noqa: E402
from tests.parity.test_grpo_logps_trainer import count_op_calls, make_trainer, needs_fused_head  # noqa: E402


P = glue.NogradPoint
BF16 = torch.bfloat16


def rule(n, h, v, dtype=BF16, entropy=True, backend="triton", table=()):
    return glue.nograd_prefers_stock(n, h, v, dtype, entropy, backend, table=table)


# ------------------------------------------------------------------------------------------------------ the rule
def test_rule_reproduces_every_measured_point():
    """At a measured point the rule says what was measured: TRL's head unless leantrain's median was lower by more
    than the timing noise."""
    assert glue.NOGRAD_MEASURED, "the rule has no measurements"
    for p in glue.NOGRAD_MEASURED:
        expected = p.fused_ms > p.stock_ms * (1 - glue.NOGRAD_NOISE)
        assert glue.nograd_prefers_stock(p.n, p.h, p.v, p.dtype, p.entropy) == expected, p


def test_a_tie_within_the_noise_goes_to_the_stock_head():
    tie, faster = 1 - glue.NOGRAD_NOISE / 2, 1 - 2 * glue.NOGRAD_NOISE
    assert P(4096, 1000, 100_000, "bfloat16", True, 1.0, tie).stock_wins
    assert not P(4096, 1000, 100_000, "bfloat16", True, 1.0, faster).stock_wins


def test_measured_shapes_need_no_row_count():
    """Every measured cell has one verdict over N, so the trainer never counts labels (a host sync) to decide."""
    for p in glue.NOGRAD_MEASURED:
        cell = {
            q.stock_wins
            for q in glue.NOGRAD_MEASURED
            if (q.h, q.v, q.dtype, q.entropy) == (p.h, p.v, p.dtype, p.entropy)
        }
        assert len(cell) == 1, p


def test_rule_nearest_n_within_a_cell():
    table = (P(1024, 1000, 100_000, "bfloat16", True, 1.0, 2.0), P(8192, 1000, 100_000, "bfloat16", True, 9.0, 8.0))
    # log-midpoint of 1024 and 8192 is 2896
    assert rule(1, 1000, 100_000, table=table) and rule(2800, 1000, 100_000, table=table)
    assert not rule(3000, 1000, 100_000, table=table) and not rule(1 << 20, 1000, 100_000, table=table)
    # a lazy count is called exactly when the cell's verdict depends on N
    counted = []
    assert rule(lambda: counted.append(1) or 1500, 1000, 100_000, table=table) and counted == [1]


def test_rule_lazy_count_not_called_on_a_uniform_cell():
    table = (P(1024, 1000, 100_000, "bfloat16", True, 1.0, 2.0), P(8192, 1000, 100_000, "bfloat16", True, 8.0, 9.0))

    def never() -> int:
        raise AssertionError("counted the rows of a cell whose verdict does not depend on N")

    assert rule(never, 1000, 100_000, table=table)
    assert rule(never, 900, 120_000, table=table)  # nearest cell: the same


def test_rule_nearest_hidden_size_then_vocabulary():
    table = (
        P(4096, 1000, 150_000, "bfloat16", True, 1.0, 2.0),  # small H: TRL faster
        P(4096, 4000, 150_000, "bfloat16", True, 2.0, 1.0),  # large H: leantrain faster
        P(4096, 4000, 130_000, "bfloat16", True, 1.0, 2.0),  # large H, other vocabulary: TRL faster
    )
    assert rule(4096, 1500, 150_000, table=table)  # |log 1.5| < |log 2.67|
    assert not rule(4096, 3000, 150_000, table=table)
    assert rule(4096, 3000, 131_000, table=table)  # same H distance: the nearer vocabulary decides
    assert rule(4096, 400, 150_000, table=table) and not rule(4096, 16000, 150_000, table=table)  # extrapolates


def test_rule_prefers_the_same_entropy_flag_and_dtype():
    table = (
        P(4096, 1000, 150_000, "bfloat16", True, 1.0, 2.0),
        P(4096, 1000, 150_000, "bfloat16", False, 2.0, 1.0),
        P(4096, 1000, 150_000, "float32", True, 2.0, 1.0),
    )
    assert rule(4096, 1000, 150_000, BF16, True, table=table)
    assert not rule(4096, 1000, 150_000, BF16, False, table=table)
    assert not rule(4096, 1000, 150_000, torch.float32, True, table=table)
    assert rule(4096, 1000, 150_000, torch.float16, True, table=table)  # no fp16 cell: the 16-bit one
    assert rule(4096, 1000, 150_000, "float16", True, table=table[:1])  # no such entropy flag: the other one
    assert not rule(4096, 1000, 150_000, torch.float32, False, table=table[2:])


def test_rule_reach_backend_and_empty_table():
    table = (P(4096, 1000, 150_000, "bfloat16", True, 1.0, 2.0),)
    assert rule(4096, 1000, 75_000, table=table) and rule(4096, 1000, 300_000, table=table)
    assert not rule(4096, 1000, 74_999, table=table) and not rule(4096, 1000, 300_001, table=table)
    assert not rule(4096, 1000, 150_000, backend="torch", table=table)  # only Triton was measured
    assert not rule(4096, 1000, 150_000, table=())


def test_route_only_without_gradient(monkeypatch):
    monkeypatch.setattr(glue, "nograd_prefers_stock", lambda *args, **kwargs: True)
    assert not glue.nograd_route(8, 16, 32, BF16, True, "triton")
    with torch.no_grad():
        assert glue.nograd_route(8, 16, 32, BF16, True, "triton")
    with torch.inference_mode():
        assert glue.nograd_route(8, 16, 32, BF16, True, "triton")


def test_never_dispatches_below_a_method_that_is_not_trl_fused_head(monkeypatch):
    """TRL <= 1.14: the wrapped forward's original is the model's own (full logits), not a head the rule measured."""
    monkeypatch.setattr(glue, "nograd_prefers_stock", lambda *args, **kwargs: True)
    model = tiny_model("llama", vocab_size=64, hidden=32, layers=1)
    st = glue.HeadSettings(1.0, glue.FUSED_OUTPUTS, False, 1.0, None, "base_model", model.config)
    with torch.no_grad():
        assert not glue.nograd_uses_stock(model.forward, model, st, {"labels": torch.zeros(1, 4, dtype=torch.long)})


# --------------------------------------------------------------------------------------------- the trainer's path
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
    leantrain.patch_trainer(trainer)
    calls = count_op_calls(monkeypatch)
    monkeypatch.setattr(glue, "nograd_prefers_stock", lambda *args, **kwargs: True)
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
    leantrain.patch_trainer(trainer)
    calls = count_op_calls(monkeypatch)
    monkeypatch.setattr(glue, "nograd_prefers_stock", lambda *args, **kwargs: False)
    ours = outputs(trainer)
    assert len(calls) == 2  # policy and reference: leantrain's op
    for a, b in zip(stock, ours):
        torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=1e-5)  # as the fused-forward parity test
    monkeypatch.setattr(glue, "nograd_prefers_stock", lambda *args, **kwargs: True)
    out, _ = outputs(trainer, no_grad=False)  # a gradient is wanted: the gradient path is unchanged
    assert len(calls) == 4 and out.log_probs.requires_grad
    out.log_probs.sum().backward()
    assert trainer.model.model.layers[0].mlp.up_proj.weight.grad is not None


@needs_fused_head
def test_rule_sees_the_calls_shape_and_counts_labels(model_dir, tmp_path, monkeypatch):
    """The real rule through the wrapped forward (its backend forced to the measured one): N is the count of scored
    labels, H and V the head's, the policy asks for the entropy and the reference model does not."""
    trainer = make_trainer(model_dir, tmp_path, beta=0.1, bf16=False)
    leantrain.patch_trainer(trainer)
    v, h = trainer.model.lm_head.weight.shape
    seen = []
    real = glue.nograd_prefers_stock
    # TRL's head faster up to N = 8 scored rows, leantrain's from 32 (log-midpoint 16); entropy or not alike
    table = tuple(P(n, h, v, "float32", ent, ms, 1.0) for n, ms in ((8, 0.5), (32, 2.0)) for ent in (True, False))

    def spy(n, h_, v_, dtype, entropy, backend="triton", table_=None):
        rows = n() if callable(n) else n
        seen.append((rows, h_, v_, dtype, entropy, backend))
        return real(rows, h_, v_, dtype, entropy, "triton", table=table)

    monkeypatch.setattr(glue, "nograd_prefers_stock", spy)
    calls = count_op_calls(monkeypatch)
    outputs(trainer, valid=2)
    outputs(trainer, valid=12)
    # scored: labels[:, 1:] != -100; valid=2: 2 per row; valid=12: columns 1-11, row 1 padded up to column 3
    assert [s[0] for s in seen] == [6, 6, 11 + 8 + 11, 11 + 8 + 11]
    assert {(s[1], s[2], s[3], s[5]) for s in seen} == {(h, v, torch.float32, "torch")}
    assert [s[4] for s in seen] == [True, False, True, False]
    assert len(calls) == 2  # 6 rows: TRL's head; 29 rows: leantrain's op


@needs_fused_head
def test_report_names_the_dispatch(model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(model_dir, tmp_path, beta=0.1, bf16=False)
    v, h = trainer.model.lm_head.weight.shape
    assert glue.nograd_detail([("model", trainer.model)], trainer.args) == ""  # CPU: the rule covers Triton only
    monkeypatch.setattr(ops, "default_backend", lambda device: "triton")
    monkeypatch.setattr(glue, "NOGRAD_MEASURED", (P(64, h, v, "float32", True, 1.0, 2.0),))
    detail = glue.nograd_detail([("model", trainer.model), ("ref_model", trainer.ref_model)], trainer.args)
    report = leantrain.patch_trainer(trainer)
    assert report["grpo_logps"].detail.endswith("kernel: torch chunked; " + detail)
    # the reference head asks no entropy: no such cell, the entropy one is the nearest
    assert detail.startswith(f"no-grad calls at policy H={h} V={v} (any N), ref model H={h} V={v} (any N) use TRL")
    assert glue.NOGRAD_SOURCE in detail


def test_rule_never_raises_on_an_unknown_dtype_name():
    table = (P(4096, 1000, 150_000, "bfloat16", True, 1.0, 2.0),)
    assert rule(4096, 1000, 150_000, "no_such_dtype", True, table=table)  # the nearest cell still decides
