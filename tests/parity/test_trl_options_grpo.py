"""GRPO and RLOO through ``patch_trainer`` against the unpatched trainer, over the options users set (the option
names and values read from the installed TRL's configs; see tests/_trl_options.py)."""

from __future__ import annotations

import pytest


trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import leantrain  # noqa: E402
from tests import _trl_options as opts  # noqa: E402
from tests._trl_option_cases import cases, config_keys, skip_reason  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return opts.save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def run_pair(kind, model_dir, tmp_path, **options):
    stock, ours = opts.rl_pair(kind, model_dir, tmp_path, {"grpo_logps": True}, **options)
    assert ours.report["grpo_logps"].status is leantrain.Status.APPLIED, ours.report["grpo_logps"].reasons
    return stock, ours


# ---------------------------------------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("kind, options", cases())
def test_matrix(model_dir, tmp_path, kind, options):
    reason = skip_reason(kind, options)
    if reason:
        pytest.skip(reason)
    stock, ours = run_pair(kind, model_dir, tmp_path, **options)
    if options.get("mask_truncated_completions"):  # the data has both kinds, so the mask drops some, not all
        clipped = [step["completions/clipped_ratio"] for step in stock.logs if "completions/clipped_ratio" in step]
        assert any(0 < c < 1 for c in clipped), clipped
    opts.assert_same_logs(stock, ours)
    opts.assert_same_params(stock, ours)


@pytest.mark.parametrize("config_cls", [trl.GRPOConfig, trl.RLOOConfig], ids=lambda c: c.__name__)
def test_every_option_is_classified(config_cls):
    """An option a new TRL adds fails here until it is decided on: a case, or why none is needed."""
    opts.assert_classified(config_cls, opts.RL_FIELDS)


def test_covered_options_have_a_case():
    """Each option classified as covered is set by some case of the matrix (for the installed TRL)."""
    installed = set(opts.config_fields(trl.GRPOConfig)) | set(opts.config_fields(trl.RLOOConfig))
    set_by_cases = {"num_generations", "max_completion_length", "generation_kwargs"}  # rl_trainer sets these
    for param in cases():
        set_by_cases |= config_keys(param.values[1])
    covered = {name for name, why in opts.RL_FIELDS.items() if why == opts.COVERED} & installed
    assert covered <= set_by_cases, sorted(covered - set_by_cases)


def test_top_entropy_quantile_ties(model_dir, tmp_path):
    """Regression (GRPO trained on another loss under ``top_entropy_quantile``): the first completion token of every
    generation of one prompt has the same logits, so the stock head gives them bitwise equal entropies, and TRL's
    mask (entropy >= the quantile) keeps all or none of them. Entropies that depend on the sampled target in their
    last bit split those ties: with one completion token per generation, the mask then keeps one generation of each
    pair instead of both, and the step-1 loss (which cancels to ~0 over a pair) is off by a whole advantage. One prompt
    a step, so the quantile of the two tied values is the tied value itself."""
    if not opts.has_option(trl.GRPOConfig, "top_entropy_quantile"):
        pytest.skip(f"trl {trl.__version__} has no top_entropy_quantile")
    stock, ours = run_pair(
        "grpo",
        model_dir,
        tmp_path,
        max_completion_length=1,
        per_device_train_batch_size=2,
        top_entropy_quantile=0.5,
        temperature=0.9,
        beta=0.05,
    )
    opts.assert_same_logs(stock, ours)
    opts.assert_same_params(stock, ours)
