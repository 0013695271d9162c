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

from leantrain._measure import Completions
from leantrain.tiny import corpus_texts, tiny_model, train_tokenizer


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


def rl_pair(kind: str, model_dir: str, out: Path, patch: dict[str, Any], **options: Any) -> tuple[Run, Run]:
    """The stock run, then the patched one on the completions the stock run sampled (replayed: sampling is not what
    is compared, and a last-bit difference in a sampled logit must not change what the steps train on)."""
    record = Completions("record")
    stock_trainer = rl_trainer(kind, model_dir, out / "stock", **options)
    record.install(stock_trainer)
    stock = train(stock_trainer)
    import leantrain

    trainer = rl_trainer(kind, model_dir, out / "ours", **options)
    leantrain.patch_trainer(trainer, **patch)
    Completions("replay", calls=record.calls).install(trainer)
    ours = train(trainer)
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
