"""The option matrix's cases, shared by the CPU parity tests and their CUDA copies: GRPO / RLOO and SFT options
read from the installed TRL's configs (names and values), each case with the marks and skips it needs."""

from __future__ import annotations

import pytest
import trl

from tests import _trl_options as opts


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


def config_keys(options: dict) -> set[str]:
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


def skip_reason(kind: str, options: dict) -> str | None:
    cls = _config_cls(kind)
    missing = [k for k in config_keys(options) if not opts.has_option(cls, k)]
    if missing:
        return f"trl {trl.__version__}'s {cls.__name__} has no {', '.join(missing)}"
    if options.get("tool_mask"):
        import inspect

        if "tool_mask" not in inspect.getsource(trl.GRPOTrainer._compute_loss):
            return f"trl {trl.__version__}'s GRPO loss reads no tool_mask"
    return None


def sft_cases() -> list:
    cases = [
        pytest.param({"loss_type": v}, id=f"loss_type={v}") for v in opts.option_values(trl.SFTConfig, "loss_type")
    ]
    for strategy in opts.option_values(trl.SFTConfig, "packing_strategy"):
        options = {"packing": True, "packing_strategy": strategy, "max_length": 32}
        cases.append(pytest.param(options, id=f"packing={strategy}", marks=pytest.mark.slow))
    if not opts.has_option(trl.SFTConfig, "packing_strategy"):
        cases.append(pytest.param({"packing": True, "max_length": 32}, id="packing", marks=pytest.mark.slow))
    cases += [
        pytest.param({"completion_only_loss": True, "masks": "completion"}, id="completion_only_loss"),
        pytest.param({"masks": "assistant"}, id="assistant_masks"),
        pytest.param({"padding_free": True, "max_length": None}, id="padding_free", marks=pytest.mark.slow),
        pytest.param({"gradient_accumulation_steps": 2}, id="num_items_in_batch"),
        pytest.param({"compute_metrics": opts.mean_logit_metric}, id="eval_compute_metrics"),
        pytest.param({"prediction_loss_only": True, "compute_metrics": opts.mean_logit_metric}, id="eval_loss_only"),
        pytest.param({"pad_to_multiple_of": 8}, id="pad_to_multiple_of", marks=pytest.mark.slow),
        pytest.param({"eval_packing": False, "packing": True, "max_length": 32}, id="eval_packing=False",
                     marks=pytest.mark.slow),
    ]  # fmt: skip
    return cases
