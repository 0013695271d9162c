"""GRPO with leantrain under any launcher: `python`, `torchrun` or `accelerate launch` (DDP / FSDP2).

    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_grpo.py --shape qwen2.5-0.5b

Random-init model of a named shape (or a tiny one), local tokenizer, prompts from the embedded corpus, a toy reward
(share of letters). Writes per-rank step time and peak memory to ``--out``/grpo_rank<r>.json; rank 0 prints the report.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import build_model, corpus_dataset, patch_train_record, run_args
from accelerate import PartialState
from trl import GRPOConfig, GRPOTrainer

from leantrain.cli.demo import letter_reward
from leantrain.cli.tiny import train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny-llama")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="per-device batch (completions)")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--out", type=Path, default=Path("out/grpo"))
    args = parser.parse_args()

    tokenizer = train_tokenizer()
    tokenizer.padding_side = "left"
    model = build_model(args.shape, vocab_size=len(tokenizer))
    config = GRPOConfig(
        **run_args(args.out, args.steps),
        per_device_train_batch_size=args.batch,
        num_generations=args.generations,
        max_completion_length=args.completion_length,
        beta=args.beta,
        learning_rate=1e-6,
    )
    if args.beta:
        # TRL builds the reference model from a path when beta > 0: save the random-init model locally. Rank 0 writes
        # (save_pretrained skips the other ranks once torch.distributed is up); the others wait, then load it.
        local = args.out / "init-model"
        state = PartialState()
        if state.is_main_process:
            model.save_pretrained(local)
            tokenizer.save_pretrained(local)
        state.wait_for_everyone()
        model = str(local)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=letter_reward,
        args=config,
        train_dataset=corpus_dataset(args.steps * args.batch * 4, "prompt"),
        processing_class=tokenizer,
    )
    patch_train_record(trainer, args.out, "grpo")


if __name__ == "__main__":
    main()
