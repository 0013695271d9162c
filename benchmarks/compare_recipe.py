"""A recipe of ``bench_recipes.py`` as a plain training script: the target of ``leantrain compare``, which then
measures on its own what the recipe table reports (the same shapes, data, settings and step clock window).

The script builds the recipe's stock trainer exactly as ``benchmarks/recipes/`` does and calls ``train()``; it never
imports leantrain's patching (``leantrain compare`` patches the leantrain runs through ``leantrain run``'s hook):

    python -m leantrain compare --steps 6 --warmup 2 benchmarks/compare_recipe.py moe_qlora
    python -m leantrain compare --steps 7 --warmup 2 --cggr --opt cggr_min_tokens_ratio=0.25 \\
        --opt cggr_warmup_steps=0 benchmarks/compare_recipe.py sft --shape qwen2.5-0.5b

- ``moe_qlora``: the gpt-oss-20b shape (24 layers, 32 experts, top-4), LoRA r=16 on the attention projections,
  experts frozen as per-expert ``bnb.nn.Linear4bit`` lists (``--layout linear4bit``, the table's 3.15x row) or
  ``quantize_experts_4bit`` stacks (``--layout stacked``), batch 2 x 2048, bf16, gradient checkpointing.
- ``sft``: Qwen2.5-0.5B or 1.5B shape, batch 8 x 2048, bf16, gradient checkpointing (the CGGR rows: pass CGGR's
  options to compare, as above).

``--smoke``: the recipes' tiny CPU shapes, in seconds (tests/unit/test_compare.py runs both under ``leantrain run``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from recipes.moe_qlora import build_gpt_oss  # noqa: E402
from recipes.runner import checkpointing, dense_model, sft_trainer, token_dataset  # noqa: E402
from recipes.settings import FULL, SMOKE  # noqa: E402


def moe_qlora_trainer(s, layout: str, steps: int, out: Path):
    """recipes.moe_qlora's variant for ``layout``, unpatched."""
    import transformers
    from peft import LoraConfig

    fields = s.moe_shape
    model, info = build_gpt_oss(fields, layout, s)
    print(f"built gpt-oss ({layout}) in {info['build_model_s']:.1f} s", flush=True)
    transformers.set_seed(0)  # LoRA init
    lora = LoraConfig(
        r=s.lora_r,
        lora_alpha=2 * s.lora_r,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    data = token_dataset(fields["vocab_size"], steps * s.moe_batch, s.moe_seq)
    return sft_trainer(
        model,
        data,
        out,
        steps,
        s,
        peft_config=lora,
        learning_rate=2e-4,
        per_device_train_batch_size=s.moe_batch,
        max_length=s.moe_seq,
        **checkpointing(s.cuda),
    )


def sft_trainer_for(s, shape: str, steps: int, out: Path):
    """recipes.sft's stock variant for ``shape``."""
    if shape not in s.sft_shapes:
        raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(s.sft_shapes)}")
    fields = s.sft_shapes[shape]
    data = token_dataset(fields["vocab_size"], steps * s.sft_batch, s.sft_seq)
    model = dense_model("Qwen2Config", fields, s)
    return sft_trainer(
        model,
        data,
        out,
        steps,
        s,
        learning_rate=1e-5,
        per_device_train_batch_size=s.sft_batch,
        max_length=s.sft_seq,
        **checkpointing(s.cuda),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", choices=("moe_qlora", "sft"))
    parser.add_argument("--layout", choices=("linear4bit", "stacked"), default="linear4bit", help="moe_qlora experts")
    parser.add_argument("--shape", default=None, help="sft: qwen2.5-0.5b (default) or qwen2.5-1.5b")
    parser.add_argument("--steps", type=int, default=50, help="max_steps (leantrain compare caps it)")
    parser.add_argument("--smoke", action="store_true", help="the recipes' tiny CPU shapes")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory(prefix="compare_recipe_") as out:
        if args.recipe == "moe_qlora":
            trainer = moe_qlora_trainer(s, args.layout, args.steps, Path(out))
        else:
            trainer = sft_trainer_for(s, args.shape or next(iter(s.sft_shapes)), args.steps, Path(out))
        trainer.train()


if __name__ == "__main__":
    main()
