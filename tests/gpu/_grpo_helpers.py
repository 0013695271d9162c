"""GRPOTrainer stock-vs-patched setup for the CUDA suite: the CPU parity test's trainer (tests/parity/
test_grpo_logps_trainer.py) on a given device, with a slightly bigger tiny Llama, plus parameter snapshots."""

from __future__ import annotations

import warnings

import pytest
import torch


trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import transformers  # noqa: E402

from leantrain.cli.tiny import corpus_texts, tiny_model, train_tokenizer  # noqa: E402


METRICS = ("loss", "grad_norm", "kl", "entropy")


def save_model(path: str, hidden: int = 128, layers: int = 3) -> str:
    tok = train_tokenizer()
    tiny_model("llama", seed=0, vocab_size=len(tok), hidden=hidden, layers=layers).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_trainer(model_dir, out_dir, *, use_cpu=False, beta=0.0, lora=False, record=None, **overrides):
    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [" ".join(t.split()[:6]) for t in corpus_texts()[:16]]

    def reward(completions, **kwargs):
        if record is not None:
            record.append(list(completions))
        return [len(c) / 10 + c.count("e") for c in completions]

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    settings = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=3,
        logging_steps=1,
        report_to="none",
        use_cpu=use_cpu,
        beta=beta,
        seed=0,
        learning_rate=1e-2,
        save_strategy="no",
        temperature=0.7,
        dataloader_pin_memory=False,
        bf16=False,  # GRPOConfig defaults to bf16 autocast: the "fp32" configurations must say fp32
    )
    settings.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=trl.GRPOConfig(**settings),
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
            peft_config=peft_config,
        )


def trajectory(trainer) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [{k: h[k] for k in METRICS if k in h} for h in trainer.state.log_history if "loss" in h]


def trainable_params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def matching_steps(stock_generations: list, our_generations: list) -> int:
    """Optimizer steps whose completions are identical (generation runs once per step here; a sample can flip once
    the parameters differ by rounding, after which the trajectories are no longer comparable)."""
    n = 0
    for a, b in zip(stock_generations, our_generations):
        if a != b:
            break
        n += 1
    return n
