"""GRPO recipes: TRL GRPOTrainer, stock vs patch_trainer(grpo_logps=True)."""

from __future__ import annotations

import argparse
import copy
import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .runner import (
    Budget,
    StepClock,
    Variant,
    checkpointing,
    cleanup,
    dense_model,
    filtered,
    leantrain_patch,
    log,
    run_both_orders,
    selected,
    short_shape,
    tokenizer,
    trainer_args,
)
from .settings import Settings


def completion_stats(clock: StepClock) -> Callable[[Any, tuple], None]:
    """Record what ``_generate`` produced: token counts and a hash of the completion ids (same completions?)."""

    def after(result: Any, args: tuple) -> None:
        prompt_ids, completion_ids = result[0], result[1]
        ids = [[int(t) for t in c] for c in completion_ids]
        clock.tokens += sum(map(len, prompt_ids)) + sum(map(len, ids))
        clock.extra["completion_tokens"] = sum(map(len, ids))
        clock.extra["completion_lengths"] = [len(c) for c in ids]
        clock.extra["completion_hash"] = hashlib.sha256(repr(ids).encode()).hexdigest()[:16]

    return after


def grpo_hooks(trainer: Any, clock: StepClock) -> None:
    clock.wrap(trainer, "_generate", "generation", after=completion_stats(clock))
    clock.wrap(trainer, "_get_per_token_logps_and_entropies", "logps", when=lambda: not torch.is_grad_enabled())


def prompts_and_tokenizer() -> tuple[Any, Any]:
    """Prompts of 16 words from leantrain.cli.tiny's corpus and its tokenizer, left-padded (as generation needs)."""
    from datasets import Dataset

    from leantrain.cli.tiny import corpus_texts

    tok = tokenizer()
    tok.padding_side = "left"
    texts = corpus_texts()
    return Dataset.from_dict({"prompt": [" ".join(t.split()[:16]) for t in texts[:64]]}), tok


def grpo_trainer(model: Any, prompts: Any, tok: Any, out: Path, steps: int, beta: float, lr: float, s: Settings, **kw):
    from trl import GRPOConfig, GRPOTrainer

    from leantrain.cli.demo import letter_reward

    grpo_args = GRPOConfig(
        **trainer_args(out, steps, s),
        per_device_train_batch_size=s.grpo_batch,
        num_generations=s.grpo_generations,
        max_completion_length=s.grpo_completion,
        beta=beta,
        learning_rate=lr,
        **checkpointing(s.cuda),  # TRL's default (on); off for the CPU smoke run
    )
    return GRPOTrainer(
        model=model, reward_funcs=letter_reward, args=grpo_args, train_dataset=prompts, processing_class=tok, **kw
    )


def grpo_pair(recipe: str, config: str, make: Callable[[], Any], settings: dict[str, Any]) -> list[Variant]:
    stock = Variant(recipe, config, "stock", "stock", None, make, None, grpo_hooks, settings)
    patch = leantrain_patch(grpo_logps=True)
    return [stock, Variant(recipe, config, "leantrain", "leantrain", "stock", make, patch, grpo_hooks, settings)]


def time_pair(
    pair: list[Variant],
    i: int,
    steps: tuple[int, int],
    orders: int,
    s: Settings,
    budget: Budget,
    args: argparse.Namespace,
) -> list[dict]:
    """The first config of a shape primes the kernels of both variants (beta > 0 runs every one of them); each
    pair runs in both orders (runner.run_both_orders). With one order, configs alternate which variant goes first;
    --reverse swaps the first order either way."""
    orders = args.orders or orders
    first = pair if (i * (orders == 1) + args.reverse) % 2 == 0 else pair[::-1]
    chosen = filtered(first, args.only)
    return run_both_orders(chosen, steps, s, budget, prime=i == 0, orders=orders if len(chosen) > 1 else 1)


def grpo_settings(shape: str, beta: float, lr: float, s: Settings, **more: Any) -> dict[str, Any]:
    return dict(
        shape=shape,
        batch=s.grpo_batch,
        generations=s.grpo_generations,
        completion_length=s.grpo_completion,
        beta=beta,
        lr=lr,
        checkpointing=s.cuda,
        **more,
    )


def recipe_grpo(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    warmup, timed = s.grpo_steps
    prompts, tok = prompts_and_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="recipes_grpo_"))
    records: list[dict] = []
    try:
        for shape, fields in selected(s.grpo_shapes, args.shapes).items():
            t0 = time.perf_counter()
            pristine = dense_model("Qwen2Config", fields, s)
            path = tmp / shape
            pristine.save_pretrained(path)  # TRL builds the reference model from the policy's path when beta > 0
            pristine.config._name_or_path = str(path)
            log(f"grpo {shape}: built and saved in {time.perf_counter() - t0:.1f} s")
            for i, beta in enumerate(args.betas or s.grpo_betas):
                config = f"{short_shape(shape)} beta={beta:g}"

                def make(beta=beta) -> Any:
                    model = copy.deepcopy(pristine)
                    return grpo_trainer(model, prompts, tok, tmp / "out", warmup + timed, beta, 1e-6, s)

                pair = grpo_pair("grpo", config, make, grpo_settings(shape, beta, 1e-6, s))
                records += time_pair(pair, i, s.grpo_steps, s.grpo_orders, s, budget, args)
            pristine = None
            cleanup()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records


def dense_lora(s: Settings) -> Any:
    """LoRA r=lora_r on every attention and MLP projection (the LM head stays frozen: leantrain's frozen-head
    kernel), seeded by the caller."""
    from peft import LoraConfig

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return LoraConfig(
        r=s.lora_r, lora_alpha=2 * s.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets
    )


def recipe_grpo_lora(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    """LoRA GRPO at the Qwen2.5-7B shape: a fresh seeded bf16 model per variant (no pristine copy: 15 GB), the
    PEFT adapters built by TRL from ``peft_config``. With beta > 0 TRL takes the base model (adapters disabled) as
    the reference: no second model."""
    import transformers

    warmup, timed = s.grpo_lora_steps
    prompts, tok = prompts_and_tokenizer()
    fields = s.grpo_lora_shape
    layers = args.layers[0] if args.layers else fields["num_hidden_layers"]
    fields = dict(fields, num_hidden_layers=layers)
    tmp = Path(tempfile.mkdtemp(prefix="recipes_grpo_lora_"))
    records: list[dict] = []
    try:
        for i, beta in enumerate(args.betas or s.grpo_lora_betas):
            config = f"{short_shape(s.grpo_lora_name)} {layers}L LoRA r{s.lora_r} beta={beta:g}"
            settings = grpo_settings(
                s.grpo_lora_name, beta, 1e-5, s, layers=layers, lora_r=s.lora_r, lora_targets="attention+MLP"
            )

            def make(beta=beta) -> Any:
                model = dense_model("Qwen2Config", fields, s)
                transformers.set_seed(0)  # LoRA init
                lora = dense_lora(s)
                return grpo_trainer(model, prompts, tok, tmp / "out", warmup + timed, beta, 1e-5, s, peft_config=lora)

            pair = grpo_pair("grpo_lora", config, make, settings)
            records += time_pair(pair, i, s.grpo_lora_steps, s.grpo_lora_orders, s, budget, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records
