"""SFT with leantrain under any launcher: `python`, `torchrun` or `accelerate launch` (DDP, FSDP2, DeepSpeed).

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/train_sft.py --shape qwen2.5-0.5b
    LEANTRAIN_CGGR=1 python examples/train_sft.py    # CGGR is opt-in: it changes which tokens train
    python examples/train_sft.py --lora               # LoRA adapters, frozen base and head
    python examples/train_sft.py --shape qwen3-30b-a3b --layers 4 --moe-4bit --lora   # MoE QLoRA (bitsandbytes)

Full fine-tuning (every weight, the LM head included, trains) unless ``--lora``. ``--moe-4bit`` quantizes the MoE
experts to frozen packed nf4 stacks (``leantrain.quantize_experts_4bit``) and puts LoRA on attention only.

Builds a random-init model of a named shape (or a tiny one), the local BPE tokenizer and the embedded corpus (no hub),
patches the trainer, trains, and writes per-rank step time and peak memory to ``--out``/sft_rank<r>.json. The patch
report is printed by rank 0 only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from _common import build_model, corpus_dataset, lora_config, patch_train_record, run_args
from trl import SFTConfig, SFTTrainer

from leantrain.cli.tiny import train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="tiny-llama", help="tiny-<family> or a named shape, e.g. qwen2.5-0.5b")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="per-device batch size")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's decoder layer count")
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on attention and MLP; base and head frozen")
    parser.add_argument("--moe-4bit", action="store_true", help="experts as frozen nf4 stacks, LoRA on attention")
    parser.add_argument("--out", type=Path, default=Path("out/sft"))
    args = parser.parse_args()

    tokenizer = train_tokenizer()
    model = build_model(args.shape, vocab_size=len(tokenizer), layers=args.layers)
    peft_config = None
    if args.moe_4bit:
        import leantrain

        leantrain.quantize_experts_4bit(model)
        peft_config = lora_config(attention_only=True)
    elif args.lora:
        peft_config = lora_config()
    config = SFTConfig(
        **run_args(args.out, args.steps),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        max_length=args.seq,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    dataset = corpus_dataset(args.steps * args.batch * args.grad_accum * int(os.environ.get("WORLD_SIZE", 1)) * 2)
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    patch_train_record(trainer, args.out, "sft")


if __name__ == "__main__":
    main()
