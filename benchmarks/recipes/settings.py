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
QWEN_7B = shapes.config("qwen2.5-7b", max_position_embeddings=32768, rms_norm_eps=1e-6)  # untied head
# Qwen3-30B-A3B: 48 layers released; the recipe builds fewer (settings.moex_layers) and projects the memory
QWEN3_30B_A3B = shapes.config("qwen3-30b-a3b", max_position_embeddings=40960, rms_norm_eps=1e-6)
# Dense SFT (recipes/dense_sft.py): config class, fields, attention. Gemma 2 eager (its attention softcapping)
DENSE = {
    "gemma-2-2b": dict(cls="Gemma2Config", fields=shapes.config("gemma-2-2b", max_position_embeddings=8192,
                                                                  rms_norm_eps=1e-6), attention="eager"),
    "qwen2.5-1.5b": dict(cls="Qwen2Config", fields=QWEN["qwen2.5-1.5b"], attention="sdpa"),
    "llama-3.2-1b": dict(cls="LlamaConfig", fields=LLAMA_1B, attention="sdpa"),
}  # fmt: skip


# Smoke: vocab 2048 = leantrain.cli.tiny's tokenizer (GRPO prompts are real text); 4-bit sizes are multiples of the
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
TINY_UNTIED = dict(TINY, tie_word_embeddings=False)  # the 7B's untied head, at the smoke size
TINY_GEMMA2 = dict(TINY, head_dim=16, query_pre_attn_scalar=16, final_logit_softcapping=30.0)
TINY_QWEN3_MOE = dict(  # sizes multiples of the 4-bit blocksize (64)
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
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
    grpo_orders: int  # 2: each pair timed in both orders (stock first, then leantrain first), medians over both
    grpo_lora_name: str
    grpo_lora_shape: dict
    grpo_lora_betas: tuple[float, ...]
    grpo_lora_steps: tuple[int, int]
    grpo_lora_orders: int  # the 7B's priming round + both orders would not fit 8 minutes of H100 time
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
    moex_name: str
    moex_shape: dict  # the whole model's config; moex_layers says how many decoder layers are built
    moex_layers: tuple[int, ...]  # one config per count; two counts give the per-layer memory (projected to all)
    moex_batch: int
    moex_seq: int
    moex_steps: tuple[int, int]
    osft_name: str
    osft_shape: dict
    osft_batch: int
    osft_seq: int
    osft_steps: tuple[int, int]
    dense_shapes: dict[str, dict]  # name -> {cls, fields, attention}
    dense_batch: int
    dense_seq: int
    dense_steps: tuple[int, int]
    dense_lora_r: int
    dense_compile: str  # torch.compile backend of the regional-compile variant
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
    grpo_steps=(1, 3),  # per order, after the priming round (which leaves one warm-up step enough): 6 timed
    grpo_orders=2,
    grpo_lora_name="qwen2.5-7b",
    grpo_lora_shape=QWEN_7B,
    grpo_lora_betas=(0.0,),  # beta 0.04 (base model as reference, adapters off): its own call, --betas 0.04
    grpo_lora_steps=(1, 3),  # after the priming round one warm-up step is enough
    grpo_lora_orders=1,
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
    moex_name="qwen3-30b-a3b",
    moex_shape=QWEN3_30B_A3B,
    moex_layers=(2, 4),
    moex_batch=1,  # 1 x 2048: one sequence of a long-context SFT set (what fits a 24 GiB card is the question)
    moex_seq=2048,
    moex_steps=(2, 4),
    osft_name="llama-1b",
    osft_shape=LLAMA_1B,
    osft_batch=4,
    osft_seq=2048,
    osft_steps=(2, 5),
    dense_shapes=DENSE,
    dense_batch=4,
    dense_seq=2048,
    dense_steps=(2, 8),  # median of 8 steps after 2 of warm-up (the first step, compiles included, is recorded)
    dense_lora_r=16,
    dense_compile="inductor",
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
    grpo_orders=2,
    grpo_lora_name="tiny-qwen2",
    grpo_lora_shape=TINY_UNTIED,
    grpo_lora_betas=(0.04,),  # beta > 0 runs every path beta 0 runs, and the adapters-disabled reference
    grpo_lora_steps=(1, 1),
    grpo_lora_orders=1,
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
    moex_name="tiny-qwen3-moe",
    moex_shape=TINY_QWEN3_MOE,
    moex_layers=(1, 2),
    moex_batch=1,
    moex_seq=32,
    moex_steps=(1, 1),
    osft_name="tiny-llama",
    osft_shape=TINY,
    osft_batch=2,
    osft_seq=64,
    osft_steps=(1, 1),
    dense_shapes={"tiny-gemma2": dict(cls="Gemma2Config", fields=TINY_GEMMA2, attention="eager")},
    dense_batch=2,
    dense_seq=64,
    dense_steps=(1, 1),
    dense_lora_r=4,
    dense_compile="eager",  # Dynamo's capture without code generation: seconds on a CPU
    budget_s=1e9,
)
