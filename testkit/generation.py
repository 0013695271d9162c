"""GRPO / RLOO trainers on a tiny saved model, for the compiled-generation tests on CPU and CUDA: prompts of varying
length (so the left-padded prompt width changes from batch to batch), a reward that is a plain function of the text,
and the completions each trainer generated."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from leantrain.cli.tiny import corpus_texts, tiny_model, train_tokenizer


VOCAB = 512


def save_tiny(path: Path, family: str = "qwen2", hidden: int = 64, layers: int = 2) -> Path:
    """A tiny seeded model and its tokenizer saved at ``path`` (TRL builds the reference model from a path)."""
    if not (path / "config.json").exists():
        model = tiny_model(family, seed=0, vocab_size=VOCAB, hidden=hidden, layers=layers)
        model.config._attn_implementation = "sdpa"  # what users generate with
        model.save_pretrained(path)
        train_tokenizer(VOCAB).save_pretrained(path)
    return path


def prompts(n: int = 16) -> list[str]:
    """Prompts of 3 to 10 words: the generation batches' padded widths differ."""
    return [" ".join(text.split()[: 3 + (7 * i) % 8]) for i, text in enumerate(corpus_texts()[:n])]


def reward(completions: list[str], **_: Any) -> list[float]:
    return [len(c) / 10 + c.count("e") for c in completions]


def trainer(
    model_dir: Path,
    out: Path,
    *,
    kind: str = "grpo",
    lora: bool = False,
    record: list[str] | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    n_prompts: int = 16,
    **config: Any,
) -> Any:
    """A GRPOTrainer (or RLOOTrainer) on the saved tiny model; ``config`` overrides the trainer's config fields."""
    import datasets
    import transformers
    import trl

    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)

    def scored(completions: list[str], **kwargs: Any) -> list[float]:
        if record is not None:
            record.extend(completions)
        return reward(completions)

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    fields = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=3,
        logging_steps=1,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=dtype == torch.bfloat16,
        beta=0.0,
        seed=0,
        learning_rate=1e-2,
        save_strategy="no",
        temperature=0.7,
        disable_tqdm=True,
    )
    fields.update(config)
    rloo = kind == "rloo"
    config_cls, trainer_cls = (trl.RLOOConfig, trl.RLOOTrainer) if rloo else (trl.GRPOConfig, trl.GRPOTrainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=model,
            reward_funcs=scored,
            args=config_cls(**fields),
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts(n_prompts)}),
            processing_class=tok,
            peft_config=peft_config,
        )


def losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def trainable(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def batch(tok: Any, texts: list[str], device: str = "cpu") -> dict[str, torch.Tensor]:
    """Left-padded prompts, as TRL hands them to generate."""
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}
