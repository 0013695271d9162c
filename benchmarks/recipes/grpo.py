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
    run_group,
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


def recipe_grpo(s: Settings, budget: Budget, args: argparse.Namespace) -> list[dict]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from leantrain.demo import letter_reward
    from leantrain.tiny import corpus_texts

    tok = tokenizer()
    tok.padding_side = "left"
    warmup, timed = s.grpo_steps
    texts = corpus_texts()
    prompts = Dataset.from_dict({"prompt": [" ".join(t.split()[:16]) for t in texts[:64]]})
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
                settings = dict(
                    shape=shape,
                    batch=s.grpo_batch,
                    generations=s.grpo_generations,
                    completion_length=s.grpo_completion,
                    beta=beta,
                    lr=1e-6,
                    checkpointing=s.cuda,
                )

                def make(beta=beta) -> Any:
                    grpo_args = GRPOConfig(
                        **trainer_args(tmp / "out", warmup + timed, s),
                        per_device_train_batch_size=s.grpo_batch,
                        num_generations=s.grpo_generations,
                        max_completion_length=s.grpo_completion,
                        beta=beta,
                        learning_rate=1e-6,
                        **checkpointing(s.cuda),  # TRL's default (on); off for the CPU smoke run
                    )
                    return GRPOTrainer(
                        model=copy.deepcopy(pristine),
                        reward_funcs=letter_reward,
                        args=grpo_args,
                        train_dataset=prompts,
                        processing_class=tok,
                    )

                stock = Variant("grpo", config, "stock", "stock", None, make, None, grpo_hooks, settings)
                patched = Variant(
                    "grpo",
                    config,
                    "leantrain",
                    "leantrain",
                    "stock",
                    make,
                    leantrain_patch(grpo_logps=True),
                    grpo_hooks,
                    settings,
                )
                # alternate (drift shows as noise); --reverse swaps, to repeat a pair in the other order
                order = [stock, patched] if (i + args.reverse) % 2 == 0 else [patched, stock]
                # the first config of a shape primes the kernels of both variants (beta > 0 runs every one of them)
                records += run_group(filtered(order, args.only), s.grpo_steps, s, budget, prime=i == 0)
            pristine = None
            cleanup()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records
