"""GRPO and RLOO through ``patch_trainer`` against the unpatched trainer, over the options users set (the option
names and values read from the installed TRL's configs; see tests/_trl_options.py)."""

from __future__ import annotations

import pytest


trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

import leantrain  # noqa: E402
from tests import _trl_options as opts  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return opts.save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def run_pair(kind, model_dir, tmp_path, **options):
    stock, ours = opts.rl_pair(kind, model_dir, tmp_path, {"grpo_logps": True}, **options)
    assert ours.report["grpo_logps"].status is leantrain.Status.APPLIED, ours.report["grpo_logps"].reasons
    return stock, ours


# ---------------------------------------------------------------------------------------------------- the matrix
def _loss_type_cases() -> list:
    cases = []
    for loss_type in opts.option_values(trl.GRPOConfig, "loss_type"):
        options = {"loss_type": loss_type, "num_iterations": 2}  # ratios != 1: clipping and soft gates act
        if loss_type == "luspo":  # TRL: a sequence-level loss
            options["importance_sampling_level"] = "sequence"
        marks = () if loss_type == "dapo" else pytest.mark.slow  # TRL's default runs in the fast set
        cases.append(pytest.param("grpo", options, id=f"grpo-loss_type={loss_type}", marks=marks))
    return cases


def _scale_rewards_cases() -> list:
    return [
        pytest.param("grpo", {"scale_rewards": value}, id=f"grpo-scale_rewards={value}", marks=pytest.mark.slow)
        for value in opts.option_values(trl.GRPOConfig, "scale_rewards")
    ]


# name: options; each changes what the loss reads. A case whose option the installed TRL lacks skips with the reason.
COMMON = {
    "beta": {"beta": 0.05},
    "num_iterations": {"num_iterations": 2},
    "epsilon_high": {"num_iterations": 2, "epsilon_high": 0.28, "epsilon": 0.02},
    "temperature": {"temperature": 0.7},
    "mask_truncated_completions": {"mask_truncated_completions": True},
    "padding_right": {"padding_side": "right"},
    "steps_per_generation": {"steps_per_generation": 2, "gradient_accumulation_steps": 2},
    "pad_to_multiple_of": {"pad_to_multiple_of": 8},
}
# the fast set (every other case is marked slow): the options whose paths differ most inside leantrain (the entropy
# and its gradient, the reference model, old log-probs, padding sides, masks)
FAST = {"top_entropy_quantile", "entropy_coef", "beta", "num_iterations", "padding_right", "tool_mask"}
GRPO_ONLY = {
    "importance_sampling_level=sequence": {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    "top_entropy_quantile": {"top_entropy_quantile": 0.5, "temperature": 0.9, "beta": 0.05},
    "entropy_coef": {"entropy_coef": 0.05},
    "off_policy_mask_threshold": {"off_policy_mask_threshold": 0.01, "num_iterations": 2},
    "delta": {"delta": 1.05, "num_iterations": 2},
    "use_bias_correction_kl": {"use_bias_correction_kl": True, "beta": 0.05, "num_iterations": 2},
    "cast_lm_head_to_fp32": {"cast_lm_head_to_fp32": True},
    "tool_mask": {"tool_mask": True},
}
RLOO_ONLY = {
    "normalize_advantages": {"normalize_advantages": True},
    "reward_clip_range": {"reward_clip_range": (0.0, 2.0)},
}


def _config_keys(options: dict) -> set[str]:
    return set(options) - {"padding_side", "tool_mask"}


def cases() -> list:
    out = [pytest.param("grpo", {}, id="grpo-defaults"), pytest.param("rloo", {}, id="rloo-defaults")]
    out += _loss_type_cases() + _scale_rewards_cases()
    for kind, table in (("grpo", {**COMMON, **GRPO_ONLY}), ("rloo", {**COMMON, **RLOO_ONLY})):
        for name, options in table.items():
            marks = () if kind == "grpo" and name in FAST else pytest.mark.slow
            out.append(pytest.param(kind, options, id=f"{kind}-{name}", marks=marks))
    return out


def _config_cls(kind: str):
    return trl.GRPOConfig if kind == "grpo" else trl.RLOOConfig


def _skip_reason(kind: str, options: dict) -> str | None:
    cls = _config_cls(kind)
    missing = [k for k in _config_keys(options) if not opts.has_option(cls, k)]
    if missing:
        return f"trl {trl.__version__}'s {cls.__name__} has no {', '.join(missing)}"
    if options.get("tool_mask"):
        import inspect

        if "tool_mask" not in inspect.getsource(trl.GRPOTrainer._compute_loss):
            return f"trl {trl.__version__}'s GRPO loss reads no tool_mask"
    return None


@pytest.mark.parametrize("kind, options", cases())
def test_matrix(model_dir, tmp_path, kind, options):
    reason = _skip_reason(kind, options)
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
        set_by_cases |= _config_keys(param.values[1])
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
