"""Trainer-level parity over the options users set (tests/parity/test_trl_options_*.py and their CUDA variants in
tests/gpu/): real TRL trainers, tiny and seeded, run twice for a few steps (stock, then through ``patch_trainer``)
and compared on every logged number and on the parameters they end with.

The option names and their allowed values are read from the installed TRL's config dataclasses
(``option_values``), and every field of a config is classified (``FIELDS_*`` in the test files): an option a new
TRL adds fails the classification test until someone decides whether the matrix must cover it."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import transformers

from leantrain.cli._measure import Completions
from leantrain.cli.tiny import corpus_texts, tiny_model, train_tokenizer


VOCAB = 512
# Logged keys that measure time or depend on the host, never the math
UNTIMED = re.compile(r"(runtime|per_second|step_time|_time$|^epoch$|total_flos)")


# ------------------------------------------------------------------------------------------------ config fields
def config_fields(config_cls: type) -> dict[str, dataclasses.Field]:
    """The fields a TRL config adds to ``transformers.TrainingArguments`` (the options of the trainer's loss)."""
    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return {f.name: f for f in dataclasses.fields(config_cls) if f.name not in base}


def has_option(config_cls: type, name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(config_cls)}


def option_values(config_cls: type, name: str) -> list[str]:
    """The string values TRL documents for ``name`` ("Supported values are 'a', 'b'..." or "`'a'`" in its help),
    and its default: what the matrix runs. Empty when the installed TRL has no such option."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    if name not in fields:
        return []
    help_text = fields[name].metadata.get("help", "")
    listed = re.search(r"(?:Supported|Possible) values (?:are|:)([^.]*)\.", help_text)
    text = listed.group(1) if listed else help_text
    values = re.findall(r"'(\w+)'", text)
    default = fields[name].default
    if isinstance(default, str):
        values.insert(0, default)
    return list(dict.fromkeys(values))


def unclassified(config_cls: type, classified: dict[str, str]) -> list[str]:
    return sorted(set(config_fields(config_cls)) - set(classified))


# ------------------------------------------------------------------------------------------------ runs
@dataclass
class Run:
    """What one training run leaves: each logged step's numbers and the final parameters (fp32 copies)."""

    logs: list[dict[str, float]]
    params: dict[str, torch.Tensor]
    report: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def logged_steps(trainer: Any) -> list[dict[str, float]]:
    steps = []
    for entry in trainer.state.log_history:
        if "loss" not in entry and "eval_loss" not in entry:
            continue
        steps.append({k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and not UNTIMED.search(k)})
    return steps


def final_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def train(trainer: Any) -> Run:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return Run(logged_steps(trainer), final_params(trainer.model))


# Two heads that differ only in fp32 summation order (the same fp32 GEMM, the normalizer summed in another order):
# per-token logp and entropy ~1e-6 apart (measured), so each logged value moves by ~1e-6 relative through 2 steps of
# the optimizer. 1e-4 relative leaves 100x room; 1e-6 absolute covers values that are ~0 (a GRPO loss whose
# advantages cancel, kl on the first step). A wrong normalizer, a dropped token, a lost mask or a missed temperature
# moves these by 1e-2 or more (test_grpo_logps_trainer's manual fail checks).
FP32_REL, FP32_ABS = 1e-4, 1e-6


def assert_same_logs(stock: Run, ours: Run, rel: float = FP32_REL, abs_tol: float = FP32_ABS) -> None:
    assert stock.logs, "the stock run logged nothing"
    assert len(stock.logs) == len(ours.logs), (len(stock.logs), len(ours.logs))
    for step, (a, b) in enumerate(zip(stock.logs, ours.logs)):
        missing = set(a) ^ set(b)
        assert not missing, f"step {step}: logged by one run only: {sorted(missing)}"
        for key in a:
            if math.isnan(a[key]) and math.isnan(b[key]):
                continue
            assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=abs_tol), (step, key, a[key], b[key])


def assert_same_params(stock: Run, ours: Run, rel: float = FP32_REL) -> None:
    """Each parameter's change over the run agrees within ``rel`` of that change's norm (plus the fp32 rounding of
    the parameter itself): compares what training did, not the (identical) initialization."""
    assert stock.params.keys() == ours.params.keys()
    for name, a in stock.params.items():
        b = ours.params[name]
        scale = a.abs().max().item()
        err = (a - b).abs().max().item()
        assert err <= rel * max(scale, 1e-3) + 2.0**-23 * scale, (name, err, scale)


# ------------------------------------------------------------------------------------------------ GRPO / RLOO
def save_tiny_model(path: Path, family: str = "llama") -> str:
    """A tiny seeded model and its tokenizer on disk: GRPO builds the beta > 0 reference model from the path."""
    tok = train_tokenizer(VOCAB)
    tiny_model(family, seed=0, vocab_size=len(tok), hidden=64, layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def reward_len_e(completions: list, **_: Any) -> list[float]:
    """A reward with spread inside each group (so advantages are nonzero): length and the count of 'e'."""
    texts = [c if isinstance(c, str) else str(c) for c in completions]
    return [len(t) / 10 + t.count("e") for t in texts]


def rl_trainer(
    kind: str,
    model_dir: str,
    out: Path,
    *,
    device: str = "cpu",
    padding_side: str = "left",
    bf16: bool = False,
    **options: Any,
) -> Any:
    """A GRPO or RLOO trainer on the tiny model: 2 prompts x 2 generations a step, 6 completion tokens, SGD (so the
    final parameters are linear in the gradients: a fair comparison after a few steps), ``options`` on the config."""
    import datasets
    import trl

    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = padding_side
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    # prompts of different lengths: padding shows
    prompts = [" ".join(t.split()[: 3 + 2 * (i % 3)]) for i, t in enumerate(corpus_texts()[:8])]
    config_cls = trl.GRPOConfig if kind == "grpo" else trl.RLOOConfig
    args = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=bf16,
        seed=0,
        optim="sgd",
        learning_rate=0.05,
        save_strategy="no",
    )
    if has_option(config_cls, "generation_kwargs"):
        # EOS made likely (e^4 over a near-uniform 512): completions of every length, some truncated, some not
        args["generation_kwargs"] = {"sequence_bias": [[[tok.eos_token_id], 4.0]]}
    args.update(options)
    trainer_cls = trl.GRPOTrainer if kind == "grpo" else trl.RLOOTrainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=model,
            reward_funcs=reward_len_e,
            args=config_cls(**args),
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
        )


def tool_mask_pattern(completion_ids: torch.Tensor) -> torch.Tensor:
    """A fixed stand-in for TRL's tool-calling mask (0 on tool-result tokens): every third completion position from
    the second on, shifted by the row, is a tool token."""
    rows, cols = completion_ids.shape
    grid = (
        torch.arange(cols, device=completion_ids.device)[None, :]
        + torch.arange(rows, device=completion_ids.device)[:, None]
    )
    return (grid % 3 != 2).long()


def inject_tool_mask(trainer: Any) -> None:
    """Add TRL's ``tool_mask`` to every scored batch, as a tool-calling rollout would (the tiny tokenizer has no chat
    template to call tools with): what the loss reads is the same as with real tools."""
    original = trainer._generate_and_score_completions

    def scored(*args: Any, **kwargs: Any) -> dict:
        out = original(*args, **kwargs)
        out["tool_mask"] = tool_mask_pattern(out["completion_ids"])
        return out

    trainer._generate_and_score_completions = scored


def rl_pair(
    kind: str, model_dir: str, out: Path, patch: dict[str, Any], tool_mask: bool = False, **options: Any
) -> tuple[Run, Run]:
    """The stock run, then the patched one on the completions the stock run sampled (replayed: sampling is not what
    is compared, and a last-bit difference in a sampled logit must not change what the steps train on)."""
    import leantrain

    runs = []
    record = Completions("record")
    for name in ("stock", "ours"):
        trainer = rl_trainer(kind, model_dir, out / name, **options)
        if name == "ours":
            leantrain.patch_trainer(trainer, **patch)
        (record if name == "stock" else Completions("replay", calls=record.calls)).install(trainer)
        if tool_mask:
            inject_tool_mask(trainer)
        runs.append(train(trainer))
    stock, ours = runs
    ours.report = leantrain.current_report(trainer)
    return stock, ours


# ------------------------------------------------------------------------------------------------ SFT
def trl_routes_liger_per_call() -> bool:
    """TRL <= 1.14 reads ``use_liger_kernel`` in every ``compute_loss`` call and hands the loss to Liger's forward
    (``skip_logits``); TRL >= 1.15 applies Liger when the trainer is built."""
    import trl

    return "skip_logits" in inspect.getsource(trl.SFTTrainer.compute_loss)


def liger_after_patch(out: Path, device: str) -> tuple[dict, Any, Any]:
    """TRL's ``test_compute_loss_skip_logits_on_eval_without_metrics_with_liger`` through leantrain: the trainer built
    and patched (fused_ce required), ``use_liger_kernel`` turned on afterwards, the model in eval mode, and one
    ``compute_loss`` call on CPU input tensors with TRL's parent ``compute_loss`` mocked (as TRL's test does).
    Returns (what the mock saw, the patch report, the report after the call)."""
    import trl

    import leantrain
    from tests._fused_ce_trainers import OFF, greedy_rows, sft_trainer, tiny

    model = tiny().to(device)
    trainer = sft_trainer(model, out, greedy_rows(model), loss_type="nll", max_length=8)
    report = leantrain.patch_trainer(trainer, **{**OFF, "fused_ce": True})
    trainer.args.use_liger_kernel = True
    trainer.model.eval()
    captured: dict = {}

    def parent_compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        captured["skip_logits"] = inputs.get("skip_logits")
        outputs = mock.MagicMock(token_accuracy=None, logits=torch.randn(1, 5, model.config.vocab_size))
        return torch.tensor(1.0, requires_grad=True), outputs

    ids = torch.tensor([[1, 2, 3, 4, 5]])  # on CPU, as in TRL's test
    inputs = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    base = trl.SFTTrainer.__mro__[1]
    with mock.patch.object(base, "compute_loss", side_effect=parent_compute_loss), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a run-time fallback warns
        trainer.compute_loss(trainer.model, inputs)
    return captured, report, leantrain.current_report(trainer)


# ------------------------------------------------------------------------------------------------ classification
# Every field a TRL config adds to TrainingArguments, in one of three classes: COVERED (a matrix case sets it; the
# test files check that one does), IRRELEVANT (cannot change what leantrain computes: why), NOT_COVERED (could, but
# the CPU matrix does not run it: why). A field a new TRL adds is in none, and the classification test fails naming
# it, so the option is decided on instead of passing silently.
COVERED = "covered"
_SAMPLING = "sampling only: the patched run replays the stock run's completions"
_VLLM = "vLLM generation, not on the CPU matrix"
_VLLM_IS = "vLLM importance-sampling correction of the loss: needs vLLM's sampling log-probs, not on the CPU matrix"
_LOGGING = "what is printed or uploaded, not what is computed"
_LOADING = "how the model or data is loaded"
_REWARD = "reward aggregation: both runs score the same completions with the same reward"
_REF_SYNC = "reference-model refresh between steps: the reference forward is the beta case's path"
_ENTROPY_CONTROL = (
    "the adaptive entropy controller changes entropy_coef between steps; the loss path is entropy_coef's"
)
_MOE = "MoE router aux loss: the tiny dense model has no router (the fused head's aux loss: test_fused_ce_sft)"
RL_FIELDS: dict[str, str] = {
    **dict.fromkeys(
        (
            "beta",
            "epsilon",
            "epsilon_high",
            "importance_sampling_level",
            "loss_type",
            "mask_truncated_completions",
            "num_iterations",
            "scale_rewards",
            "temperature",
            "top_entropy_quantile",
            "entropy_coef",
            "off_policy_mask_threshold",
            "delta",
            "use_bias_correction_kl",
            "cast_lm_head_to_fp32",
            "num_generations",
            "max_completion_length",
            "generation_kwargs",
            "steps_per_generation",
            "pad_to_multiple_of",
            "normalize_advantages",
            "reward_clip_range",
        ),
        COVERED,
    ),
    "sapo_temperature_neg": "covered at its default by loss_type='sapo'",
    "sapo_temperature_pos": "covered at its default by loss_type='sapo'",
    "vespo_k_neg": "covered at its default by loss_type='vespo'",
    "vespo_k_pos": "covered at its default by loss_type='vespo'",
    "vespo_lambda_neg": "covered at its default by loss_type='vespo'",
    "vespo_lambda_pos": "covered at its default by loss_type='vespo'",
    "generation_batch_size": "the generation batch in other units: steps_per_generation's case",
    **dict.fromkeys(
        ("entropy_coef_delta", "entropy_coef_max", "entropy_coef_min", "entropy_target"), _ENTROPY_CONTROL
    ),
    "use_adaptive_entropy": _ENTROPY_CONTROL,
    "router_aux_loss_coef": _MOE,
    **dict.fromkeys(("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"), _REF_SYNC),
    **dict.fromkeys(("reward_weights", "multi_objective_aggregation"), _REWARD),
    **dict.fromkeys(
        (
            "min_p",
            "top_k",
            "top_p",
            "repetition_penalty",
            "cache_implementation",
            "use_transformers_paged",
            "use_transformers_continuous_batching",
            "transformers_continuous_batching_config",
            "ds3_gather_for_generation",
            "max_tool_calling_iterations",
            "chat_template_kwargs",
            "num_generations_eval",
        ),
        _SAMPLING,
    ),
    **dict.fromkeys(
        (
            "log_completions",
            "log_completions_hub_repo",
            "log_multimodal",
            "log_unique_prompts",
            "num_completions_to_print",
            "wandb_log_unique_prompts",
        ),
        _LOGGING,
    ),
    **dict.fromkeys(("model_init_kwargs", "trust_remote_code", "shuffle_dataset"), _LOADING),
    "disable_dropout": "the tiny models have no dropout",
    **dict.fromkeys(
        (
            "use_vllm",
            "vllm_enable_sleep_mode",
            "vllm_gpu_memory_utilization",
            "vllm_group_port",
            "vllm_max_model_length",
            "vllm_mode",
            "vllm_model_impl",
            "vllm_server_base_url",
            "vllm_server_host",
            "vllm_server_port",
            "vllm_server_timeout",
            "vllm_structured_outputs_regex",
            "vllm_tensor_parallel_size",
            "vllm_guided_decoding_regex",
        ),
        _VLLM,
    ),
    **dict.fromkeys(
        (
            "vllm_importance_sampling_cap",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
        ),
        _VLLM_IS,
    ),
}
SFT_FIELDS: dict[str, str] = {
    **dict.fromkeys(
        (
            "completion_only_loss",
            "packing",
            "packing_strategy",
            "padding_free",
            "loss_type",
            "max_length",
            "eval_packing",
            "pad_to_multiple_of",
        ),
        COVERED,
    ),
    "router_aux_loss_coef": _MOE,
    "assistant_only_loss": (
        "covered through what it produces: rows with assistant_masks (the 'assistant_masks' case); the flag itself "
        "needs a chat template with generation tags, which the tiny tokenizer has not"
    ),
    "activation_offloading": "moves activations between devices: not on the CPU matrix (the values are the same)",
    "truncation_mode": "which tokens a row keeps: the rows here fit max_length",
    **dict.fromkeys(
        (
            "chat_template_path",
            "dataset_kwargs",
            "dataset_num_proc",
            "dataset_text_field",
            "eos_token",
            "pad_token",
            "model_init_kwargs",
            "trust_remote_code",
            "shuffle_dataset",
        ),
        _LOADING,
    ),
}


def assert_classified(config_cls: type, classified: dict[str, str]) -> None:
    new = unclassified(config_cls, classified)
    assert not new, (
        f"{config_cls.__name__} has option(s) the parity matrix has not classified: {', '.join(new)}. For each, add "
        f"a case that sets it (and mark it COVERED) or say why not, in tests/_trl_options.py"
    )


def sft_run(
    out: Path, patch: dict[str, Any] | None, *, trainer_kind: str = "sft", device: str = "cpu", **options: Any
) -> Run:
    """Two optimizer steps of an SFTTrainer (or a plain Trainer) on the fused-loss tests' rows and tiny Llama (SGD,
    so final parameters are linear in the gradients), then ``evaluate`` on the same rows; ``patch`` None: stock.
    ``options``: SFTConfig / TrainingArguments fields, plus ``masks`` ("completion" / "assistant" columns) and
    ``compute_metrics`` (a callable for evaluate: the logits path)."""
    import leantrain
    from tests._fused_ce_trainers import greedy_rows, plain_trainer, sft_trainer, tiny

    masks = options.pop("masks", None)
    compute_metrics = options.pop("compute_metrics", None)
    model = tiny().to(device)
    rows = greedy_rows(model)
    args = dict(max_steps=2, optim="sgd", learning_rate=0.1, eval_strategy="no", **options)
    if trainer_kind == "sft":
        trainer = sft_trainer(model, out, rows, masks=masks, **args)
    else:
        trainer = plain_trainer(model, out, rows, **args)
    trainer.compute_metrics = compute_metrics
    report = None if patch is None else leantrain.patch_trainer(trainer, **patch)
    run = train(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.extra["eval"] = {
            k: float(v)
            for k, v in trainer.evaluate(trainer.train_dataset if trainer_kind == "sft" else None).items()
            if isinstance(v, (int, float)) and not UNTIMED.search(k)
        }
    run.report = report
    return run


def mean_logit_metric(eval_prediction: Any) -> dict[str, float]:
    """A compute_metrics that reads the logits (so evaluation keeps them: the stock path)."""
    logits = eval_prediction.predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    return {"mean_logit": float(abs(logits).mean())}
