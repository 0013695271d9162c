"""Settings of every recipe: the full (CUDA) and smoke (CPU, tiny shapes) sets."""

from __future__ import annotations

from dataclasses import dataclass

import shapes
import torch


QWEN = {  # released configs (tied embeddings); rope settings do not change the cost
    name: shapes.config(name, max_position_embeddings=32768, rms_norm_eps=1e-6)
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b")
}
LLAMA_1B = shapes.config("llama-3.2-1b", max_position_embeddings=131072, rms_norm_eps=1e-5)  # Llama-3.2-1B
# openai/gpt-oss-20b (GptOssConfig defaults: yarn rope, swiglu limit 7, attention bias)
GPT_OSS_20B = shapes.config("gpt-oss-20b", max_position_embeddings=131072, rms_norm_eps=1e-5)


# Smoke: vocab 2048 = leantrain.tiny's tokenizer (GRPO prompts are real text); 4-bit sizes are multiples of the
# blocksize (bitsandbytes' CPU dequantize needs it, see tests/parity/test_moe4bit_model.py).
TINY = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
TINY_GPT_OSS = dict(
    num_hidden_layers=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    hidden_size=128,
    intermediate_size=64,
    vocab_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    sliding_window=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: torch.dtype
    grpo_shapes: dict[str, dict]
    grpo_batch: int  # completions per step
    grpo_generations: int
    grpo_completion: int
    grpo_betas: tuple[float, ...]
    grpo_steps: tuple[int, int]  # warm-up, timed
    sft_shapes: dict[str, dict]
    sft_batch: int
    sft_seq: int
    sft_ratios: tuple[float, ...]
    sft_steps: tuple[int, int]
    moe_shape: dict
    moe_batch: int
    moe_seq: int
    moe_steps: tuple[int, int]
    lora_r: int
    osft_name: str
    osft_shape: dict
    osft_batch: int
    osft_seq: int
    osft_steps: tuple[int, int]
    budget_s: float  # per recipe

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


FULL = Settings(
    device="cuda",
    dtype=torch.bfloat16,
    grpo_shapes=QWEN,
    grpo_batch=16,  # 2 prompts x 8 generations: generation is latency-bound, more prompts barely add time
    grpo_generations=8,
    grpo_completion=256,
    grpo_betas=(0.04, 0.0),
    grpo_steps=(2, 4),
    sft_shapes=QWEN,
    sft_batch=8,
    sft_seq=2048,
    sft_ratios=(0.25, 0.5),
    sft_steps=(2, 5),
    moe_shape=GPT_OSS_20B,
    moe_batch=2,
    moe_seq=2048,
    moe_steps=(2, 4),
    lora_r=16,
    osft_name="llama-1b",
    osft_shape=LLAMA_1B,
    osft_batch=4,
    osft_seq=2048,
    osft_steps=(2, 5),
    budget_s=450.0,
)
SMOKE = Settings(  # fp32: CPUs without bf16 matmul units run bf16 slowly
    device="cpu",
    dtype=torch.float32,
    grpo_shapes={"tiny-qwen2": TINY},
    grpo_batch=4,
    grpo_generations=4,
    grpo_completion=4,
    grpo_betas=(0.04, 0.0),
    grpo_steps=(1, 1),
    sft_shapes={"tiny-qwen2": TINY},
    sft_batch=2,
    sft_seq=64,
    sft_ratios=(0.25, 0.5),
    sft_steps=(1, 1),
    moe_shape=TINY_GPT_OSS,
    moe_batch=2,
    moe_seq=32,
    moe_steps=(1, 1),
    lora_r=4,
    osft_name="tiny-llama",
    osft_shape=TINY,
    osft_batch=2,
    osft_seq=64,
    osft_steps=(1, 1),
    budget_s=1e9,
)
